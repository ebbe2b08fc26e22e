--- The host's control endpoint for trainer agents: a unix socket inside a
--- fresh directory that only this user can enter (mode 0700), accepting only
--- peers of the same user id (SO_PEERCRED); and, when asked, a TCP socket for
--- trainer ranks in other network namespaces or hosts, whose connections must
--- prove a per-session token when they register (M.token_matches). Each
--- connection becomes a wsync.control.peer whose requests
--- `handlers_for(peer)` answers; `peer.via` is "unix" or "tcp".
local uv = require("luv")
local peer_module = require("wsync.control.peer")
local socket = require("wsync._socket")
local errors = require("wsync.errors")
local bit = require("bit")

local M = {}

--- The longest unix socket path Linux takes (sun_path is 108 bytes with its NUL).
M.MAX_SOCKET_PATH = 107

---@class wsync.EndpointOptions
---@field handlers_for fun(peer: wsync.Peer): table
---@field schemas table?
---@field on_bad_request fun(peer: wsync.Peer, cmd: string, reason: string)?
---@field on_lost fun(peer: wsync.Peer, reason: string, violation: boolean)?
---@field on_refused fun(reason: string)?
---@field parent string?  the directory the endpoint's own directory goes in ($TMPDIR, /tmp)
---@field tcp string?     also listen on TCP at "ADDRESS:PORT" (port 0: any free port)

---@class wsync.Endpoint
---@field path string     the socket's path, handed to agents
---@field directory string
local Endpoint = {}
Endpoint.__index = Endpoint

--- Opens an endpoint. `options.handlers_for(peer)` returns the handlers of the
--- requests an accepted agent may send; `schemas` the shapes of their
--- payloads and of the results the host waits for (wsync.control.peer);
--- `on_bad_request(peer, cmd, reason)` hears of a malformed request (it was
--- answered with BAD_MESSAGE); `on_lost(peer, reason, violation)` hears when a
--- connection ends; `on_refused(reason)` when one is refused.
---@param options wsync.EndpointOptions
---@return wsync.Endpoint
function M.listen(options)
  local parent = options.parent or os.getenv("TMPDIR") or "/tmp"
  -- The directory's name carries this process's pid, so that a later host
  -- can tell the leftovers of a host that died without removing them.
  local template = string.format("%s/wsync-%d-XXXXXX", parent, uv.os_getpid())
  -- A unix socket's path has to fit sockaddr_un (107 bytes and a NUL); a
  -- longer one would be cut short silently, outside the private directory.
  local length = #(template .. "/control.sock")
  if length > M.MAX_SOCKET_PATH then
    errors.raise("ENDPOINT", string.format("the control socket's path under %s would be %d bytes; unix sockets take "
      .. "at most %d: set TMPDIR to a shorter directory", parent, length, M.MAX_SOCKET_PATH))
  end
  M.remove_leftovers(parent, options.on_refused)
  local directory, message = uv.fs_mkdtemp(template)
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
  if options.tcp then
    self:_listen_tcp(options)
  end
  return self
end

--- Splits "ADDRESS:PORT" ("[v6]:PORT" for IPv6). Returns address, port, or
--- nil and why.
---@param text string
---@return string?, integer|string
function M.parse_address(text)
  local address, port = tostring(text):match("^%[([^%]]+)%]:(%d+)$")
  if not address then
    address, port = tostring(text):match("^([^:]+):(%d+)$")
  end
  port = tonumber(port)
  if not address or not port or port > 65535 then
    return nil, string.format("%s is not ADDRESS:PORT", tostring(text))
  end
  return address, port
end

--- Whether `given` is this session's token (a comparison whose time does not
--- depend on where they differ).
---@param token string
---@param given any
---@return boolean
function M.token_matches(token, given)
  if type(given) ~= "string" or #given ~= #token then
    return false
  end
  local differ = 0
  for i = 1, #token do
    differ = bit.bor(differ, bit.bxor(token:byte(i), given:byte(i)))
  end
  return differ == 0
end

-- A random 128-bit token in hex, from the kernel.
local function random_token()
  local file = assert(io.open("/dev/urandom", "rb"))
  local bytes = file:read(16)
  file:close()
  return (bytes:gsub(".", function(c)
    return string.format("%02x", c:byte())
  end))
end

function Endpoint:_listen_tcp(options)
  local address, port = M.parse_address(options.tcp)
  if not address then
    self:close()
    errors.raise("ENDPOINT", "control.tcp: " .. port)
  end
  self.tcp_server = uv.new_tcp()
  local ok, err = self.tcp_server:bind(address, port)
  if ok then
    ok, err = self.tcp_server:listen(64, function(listen_error)
      if not listen_error then
        self:_accept_tcp(options)
      end
    end)
  end
  if not ok then
    self:close()
    errors.raise("ENDPOINT", string.format("cannot listen on TCP %s: %s", options.tcp, tostring(err)))
  end
  local bound = self.tcp_server:getsockname()
  self.token = random_token()
  local host = bound.ip:find(":", 1, true) and ("[" .. bound.ip .. "]") or bound.ip
  --- What a remote agent connects to: "tcp://ADDRESS:PORT?token=HEX".
  self.tcp_endpoint = string.format("tcp://%s:%d?token=%s", host, bound.port, self.token)
end

-- Makes an accepted connection a peer of this endpoint.
function Endpoint:_peer(client, options, name, via)
  local peer
  peer = peer_module.new(client, {
    name = name,
    schemas = options.schemas,
    on_bad_request = function(cmd, reason)
      if options.on_bad_request then
        options.on_bad_request(peer, cmd, reason)
      end
    end,
    on_close = function(reason, violation)
      self.peers[peer] = nil
      if options.on_lost then
        options.on_lost(peer, reason, violation)
      end
    end,
  })
  peer.via = via
  peer.handlers = options.handlers_for(peer)
  self.peers[peer] = true
  return peer
end

function Endpoint:_accept_tcp(options)
  local client = uv.new_tcp()
  if not self.tcp_server:accept(client) then
    client:close()
    return
  end
  client:nodelay(true)
  local remote = client:getpeername() or {}
  -- (No user id over TCP: the token, at registration, stands for it.)
  self:_peer(client, options, string.format("agent at %s:%s", tostring(remote.ip), tostring(remote.port)), "tcp")
end

--- Removes the control directories under `parent` that hosts of this user
--- left when they died without cleaning up (SIGKILL): `wsync-<pid>-XXXXXX`
--- directories whose pid is gone, with at most their socket inside.
--- `report(line)` hears what was removed and what could not be. Returns the
--- paths removed.
---@param parent string
---@param report fun(line: string)?
---@return string[]
function M.remove_leftovers(parent, report)
  local removed = {}
  for _, path, pid, stat in require("wsync.util").leftovers(parent, "^wsync%-(%d+)%-%w%w%w%w%w%w$") do
    if stat.type == "directory" then
      uv.fs_unlink(path .. "/control.sock")
      local ok, message = uv.fs_rmdir(path)
      if ok then
        removed[#removed + 1] = path
      end
      if report then
        report(ok and string.format("removed %s, left by host pid %d, which is gone", path, pid)
          or string.format("cannot remove %s, left by host pid %d: %s", path, pid, tostring(message)))
      end
    end
  end
  return removed
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
  local peer = self:_peer(client, options, "agent pid " .. tostring(pid), "unix")
  peer.pid = pid
end

--- Stops accepting, closes every connection and removes the socket and its
--- directory. Returns what could not be removed (M.remove_files).
---@return string[]
function Endpoint:close()
  for _, server in ipairs({ self.server, self.tcp_server }) do
    if not server:is_closing() then
      server:close()
    end
  end
  for peer in pairs(self.peers) do
    peer:close("the host closed the endpoint")
  end
  self.peers = {}
  return self:remove_files()
end

--- Removes the socket and its directory, touching no connection (for a
--- process about to exit: its connections end with it). Returns a message
--- for each that could not be removed (a socket already gone is not one).
---@return string[]
function Endpoint:remove_files()
  local failures = {}
  local ok, message, code = uv.fs_unlink(self.path)
  if not ok and code ~= "ENOENT" then
    failures[#failures + 1] = string.format("cannot remove the control socket %s: %s", self.path, tostring(message))
  end
  ok, message, code = uv.fs_rmdir(self.directory)
  if not ok and code ~= "ENOENT" then
    failures[#failures + 1] = string.format("cannot remove the control directory %s: %s", self.directory,
      tostring(message))
  end
  return failures
end

return M
