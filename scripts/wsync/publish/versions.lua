--- Model versions of a session: monotonic, and never given out twice. A
--- publication takes its number from `next()` before anything moves; only a
--- publication that committed calls `commit(number)`. A number given to a
--- publication that failed (or that was abandoned in the REPL) is burned: the
--- next publication gets a higher one, so that no two publications ever share
--- a number, also when a runtime committed one that the host then refused.
local M = {}

---@class wsync.Versions
---@field committed integer  the newest committed version (0: none yet)
---@field issued integer     the newest number given out
local Versions = {}
Versions.__index = Versions

---@return wsync.Versions
function M.new()
  return setmetatable({ committed = 0, issued = 0 }, Versions)
end

--- The number for a new publication: above every number given out or
--- committed before.
---@return integer
function Versions:next()
  self.issued = math.max(self.issued, self.committed) + 1
  return self.issued
end

--- Records that publication `version` committed. Refuses a number that was
--- not given out, or one at or below the committed version.
---@param version integer
function Versions:commit(version)
  if version > self.issued or version <= self.committed then
    error(string.format("model version %s cannot commit: versions given out up to %d, committed %d",
      tostring(version), self.issued, self.committed), 2)
  end
  self.committed = version
end

return M
