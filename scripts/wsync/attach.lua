--- `wsync repl --attach ENDPOINT`: a read-only view of a running host. The
--- host prints its control endpoint ("control endpoint PATH"); `host:state()`
--- asks it for a snapshot (recipe, phase, committed version, ranks, runtime,
--- the publication in progress) and changes nothing there.
local uv = require("luv")
local errors = require("wsync.errors")
local loop = require("wsync.loop")
local peer_module = require("wsync.peer")

local M = {}

---@class wsync.Attached
---@field path string
local Attached = {}
Attached.__index = Attached

--- A handle on the host at `path`; it connects on first use.
---@param path string
---@return wsync.Attached
function M.new(path)
  return setmetatable({ path = path }, Attached)
end

function Attached:_connect()
  if self.peer and not self.peer.closed then
    return self.peer
  end
  local pipe = uv.new_pipe(false)
  local ok, message = loop.await(function(resume)
    pipe:connect(self.path, function(err)
      resume(err == nil, err)
    end)
  end)
  if not ok then
    pipe:close()
    errors.raise("ATTACH", string.format("cannot attach to %s: %s", self.path, tostring(message)))
  end
  self.peer = peer_module.new(pipe, { name = "host at " .. self.path })
  return self.peer
end

--- A fresh snapshot of the host's state.
function Attached:state()
  return self:_connect():request("state", {}, 10)
end

--- Leaves the host.
function Attached:close()
  if self.peer then
    self.peer:close("detached")
  end
end

function Attached:__tostring()
  return "attached host at " .. self.path
end

return M
