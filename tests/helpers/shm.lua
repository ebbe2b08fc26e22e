--- Test helper: what wsync left in /dev/shm. Segment names are
--- "/wsync-<pid>-<16 hex digits>"; /dev/shm lists them without the slash.
local uv = require("luv")

local M = {}

M.directory = "/dev/shm"

--- Sorted names ("wsync-123-...") of the segments that process `pid` created
--- (this process when `pid` is nil) and that still have a name.
---@param pid integer?
---@return string[]
function M.segments(pid)
  local prefix = "wsync-" .. tostring(pid or uv.os_getpid()) .. "-"
  local names = {}
  local scanner = assert(uv.fs_scandir(M.directory))
  while true do
    local name = uv.fs_scandir_next(scanner)
    if not name then
      break
    end
    if name:sub(1, #prefix) == prefix then
      names[#names + 1] = name
    end
  end
  table.sort(names)
  return names
end

--- The stat of a segment by its wsync name ("/wsync-..."), or nil when the
--- name is gone.
---@param name string
function M.stat(name)
  return uv.fs_stat(M.directory .. name)
end

--- Lua pattern of a segment name created by process `pid`.
---@param pid integer
function M.name_pattern(pid)
  return "^/wsync%-" .. pid .. "%-" .. string.rep("%x", 16) .. "$"
end

return M
