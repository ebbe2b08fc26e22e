--- `wsync repl --attach ENDPOINT`: a read-only view of a running host. The
--- host prints its control endpoint ("control endpoint PATH"); `host:state()`
--- asks it for a snapshot (recipe, phase, committed version, ranks, runtime,
--- the publication in progress) and changes nothing there.
local uv = require("luv")
local errors = require("wsync.errors")
local loop = require("wsync.loop")
local peer_module = require("wsync.control.peer")

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

--- A handle on the host at `path`, connected now: for code outside the loop
--- (`wsync repl --attach`), which runs the loop until the connection is made.
--- Raises ATTACH, naming the path and why, when it cannot be made.
---@param path string
---@return wsync.Attached
function M.open(path)
  local attached = M.new(path)
  local done, failure = false, nil
  loop.spawn(function()
    attached:connect()
  end, function(ok, err)
    done, failure = true, not ok and err or nil
  end)
  loop.run_until(function()
    return done
  end)
  if failure ~= nil then
    error(failure, 0)
  end
  return attached
end

-- What luv's fs_stat types are called in a message.
local type_names = { file = "regular file", char = "character device", block = "block device" }

-- Why nothing can listen at `path`, or nil when it is a socket.
local function not_a_socket(path)
  local stat, message, code = uv.fs_stat(path)
  if not stat then
    return code == "ENOENT" and "no such socket (nothing exists at that path)" or tostring(message)
  end
  if stat.type ~= "socket" then
    return string.format("not a socket (it is a %s)", type_names[stat.type] or stat.type)
  end
  return nil
end

--- Connects to the host (inside a coroutine from wsync.loop.spawn) unless
--- connected; returns its peer. Raises ATTACH, naming the path and why.
---@return wsync.Peer
function Attached:connect()
  if self.peer and not self.peer.closed then
    return self.peer
  end
  local why = not_a_socket(self.path)
  if not why then
    local pipe = uv.new_pipe(false)
    local ok, message = loop.await(function(resume)
      pipe:connect(self.path, function(err)
        resume(err == nil, err)
      end)
    end)
    if ok then
      self.peer = peer_module.new(pipe, { name = "host at " .. self.path })
      return self.peer
    end
    pipe:close()
    why = tostring(message)
    if why:match("^ECONNREFUSED") then
      why = "connection refused (no host listens there: it has exited?)"
    end
  end
  errors.raise("ATTACH", string.format("cannot attach to %s: %s", self.path, why))
end

--- A fresh snapshot of the host's state.
function Attached:state()
  return self:connect():request("state", {}, 10)
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
