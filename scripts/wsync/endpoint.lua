--- The host's control endpoint for trainer agents: a unix socket inside a
--- fresh directory that only this user can enter (mode 0700), accepting only
--- peers of the same user id (SO_PEERCRED). Each connection becomes a
--- wsync.peer whose requests `handlers_for(peer)` answers.
local uv = require("luv")
local peer_module = require("wsync.peer")
local socket = require("wsync._socket")
local errors = require("wsync.errors")

local M = {}

--- The longest unix socket path Linux takes (sun_path is 108 bytes with its NUL).
M.MAX_SOCKET_PATH = 107

---@class wsync.Endpoint
---@field path string     the socket's path, handed to agents
---@field directory string
local Endpoint = {}
Endpoint.__index = Endpoint

--- Opens an endpoint. `options.handlers_for(peer)` returns the handlers of the
--- requests an accepted agent may send; `on_lost(peer, reason)` hears when a
--- connection ends; `on_refused(reason)` when one is refused.
---@param options {handlers_for: fun(peer: wsync.Peer): table, on_lost: fun(peer: wsync.Peer, reason: string)?, on_refused: fun(reason: string)?, parent: string?}
---@return wsync.Endpoint
function M.listen(options)
  local parent = options.parent or os.getenv("TMPDIR") or "/tmp"
  -- A unix socket's path has to fit sockaddr_un (107 bytes and a NUL); a
  -- longer one would be cut short silently, outside the private directory.
  local length = #(parent .. "/wsync-XXXXXX/control.sock")
  if length > M.MAX_SOCKET_PATH then
    errors.raise("ENDPOINT", string.format("the control socket's path under %s would be %d bytes; unix sockets take "
      .. "at most %d: set TMPDIR to a shorter directory", parent, length, M.MAX_SOCKET_PATH))
  end
  local directory, message = uv.fs_mkdtemp(parent .. "/wsync-XXXXXX")
  if not directory then
    errors.raise("ENDPOINT", "cannot create a private directory for the control socket: " .. tostring(message))
  end
  uv.fs_chmod(directory, tonumber("700", 8))
  local self = setmetatable({ directory = directory, path = directory .. "/control.sock", peers = {} }, Endpoint)
  self.server = uv.new_pipe(false)
  local ok, err = self.server:bind(self.path)
  if ok then
    ok, err = self.server:listen(64, function(listen_error)
      if listen_error then
        return
      end
      self:_accept(options)
    end)
  end
  if not ok then
    self:close()
    errors.raise("ENDPOINT", string.format("cannot listen on %s: %s", self.path, tostring(err)))
  end
  return self
end

function Endpoint:_accept(options)
  local client = uv.new_pipe(false)
  if not self.server:accept(client) then
    client:close()
    return
  end
  local uid, pid = socket.peer(client:fileno())
  if uid ~= socket.own_uid() then
    client:close()
    if options.on_refused then
      options.on_refused(string.format("refused a connection from uid %s (pid %s): not this user",
        tostring(uid), tostring(pid)))
    end
    return
  end
  local peer
  peer = peer_module.new(client, {
    name = "agent pid " .. tostring(pid),
    on_close = function(reason)
      self.peers[peer] = nil
      if options.on_lost then
        options.on_lost(peer, reason)
      end
    end,
  })
  peer.pid = pid
  peer.handlers = options.handlers_for(peer)
  self.peers[peer] = true
end

--- Stops accepting, closes every connection and removes the socket and its
--- directory.
function Endpoint:close()
  if self.server and not self.server:is_closing() then
    self.server:close()
  end
  for peer in pairs(self.peers) do
    peer:close("the host closed the endpoint")
  end
  self.peers = {}
  self:remove_files()
end

--- Removes the socket and its directory, touching no connection (for a
--- process about to exit: its connections end with it).
function Endpoint:remove_files()
  uv.fs_unlink(self.path)
  uv.fs_rmdir(self.directory)
end

return M
