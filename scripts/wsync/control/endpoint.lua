--- The host's control endpoint for trainer agents: a unix socket inside a
--- fresh directory that only this user can enter (mode 0700), or at a path
--- the recipe fixes (for launchers that hand it to the ranks before the host
--- starts), accepting only peers of the same user id (SO_PEERCRED); and, when
--- asked, a TCP socket for trainer ranks in other network namespaces or
--- hosts, with a random token or one the recipe gives. Each connection
--- becomes a wsync.control.peer whose requests `handlers_for(peer)` answers;
--- `peer.via` is "unix" or "tcp".
---
--- A TCP connection is unauthenticated until its first message, which must be
--- `hello {token}` with the session's token (M.token_matches); it is answered
--- `{}` and the connection is the unix socket's equal from then on. Until
--- then its frames may be M.UNAUTHENTICATED_FRAME_LIMIT bytes (a longer one
--- is refused at its length prefix, before its body is buffered), it has
--- M.AUTHENTICATION_DEADLINE seconds, at most M.MAX_UNAUTHENTICATED such
--- connections wait at once (more are closed as they are accepted), any
--- other first message, a wrong token included, is answered with one
--- UNAUTHENTICATED error carrying M.REFUSAL and nothing more (no traceback,
--- nothing about the host) and the connection is closed, and bytes that are
--- no frame within the limit close it unanswered. (An agent waits for the
--- hello's answer before it sends more: a frame that follows the hello
--- unanswered is read with the small limit.) Every refusal is a line for
--- `on_refused`.
local uv = require("luv")
local loop = require("wsync.loop")
local peer_module = require("wsync.control.peer")
local protocol = require("wsync.control.protocol")
local socket = require("wsync._socket")
local errors = require("wsync.errors")
local bit = require("bit")

local M = {}

--- The longest unix socket path Linux takes (sun_path is 108 bytes with its NUL).
M.MAX_SOCKET_PATH = 107

--- The longest frame, in bytes, that a TCP connection may send before it has
--- proved the token (a hello is about a hundred).
M.UNAUTHENTICATED_FRAME_LIMIT = 4096

--- Seconds a TCP connection has to prove the token before it is closed.
M.AUTHENTICATION_DEADLINE = 10

--- How many TCP connections may wait to prove the token at once.
M.MAX_UNAUTHENTICATED = 16

--- The one answer a TCP connection gets for anything but the session's token.
M.REFUSAL = "refused: this session's endpoint takes connections over TCP with its token only"

---@class wsync.EndpointOptions
---@field handlers_for fun(peer: wsync.Peer): table
---@field schemas table?
---@field on_bad_request fun(peer: wsync.Peer, cmd: string, reason: string)?
---@field on_lost fun(peer: wsync.Peer, reason: string, violation: boolean)?
---@field on_refused fun(line: string)?
---@field parent string?  the directory the endpoint's own directory goes in ($TMPDIR, /tmp)
---@field path string?    the unix socket's path, instead of one in a fresh private directory
---@field tcp string?     also listen on TCP at "ADDRESS:PORT" (port 0: any free port)
---@field token string?   the token TCP connections prove (default: 128 random bits)
---@field authentication_deadline number?  seconds (M.AUTHENTICATION_DEADLINE)
---@field unauthenticated_frame_limit integer?  bytes (M.UNAUTHENTICATED_FRAME_LIMIT)
---@field max_unauthenticated integer?  (M.MAX_UNAUTHENTICATED)

---@class wsync.Endpoint
---@field path string     the socket's path, handed to agents
---@field directory string?  the private directory it is in (none for a path given)
local Endpoint = {}
Endpoint.__index = Endpoint

--- Opens an endpoint. `options.handlers_for(peer)` returns the handlers of the
--- requests an accepted agent may send; `schemas` the shapes of their
--- payloads and of the results the host waits for (wsync.control.peer);
--- `on_bad_request(peer, cmd, reason)` hears of a malformed request (it was
--- answered with BAD_MESSAGE); `on_lost(peer, reason, violation)` hears when a
--- connection ends; `on_refused(line)` when one is refused (a unix peer of
--- another user, a TCP connection that did not prove the token), and what
--- leftovers of dead hosts it removed. The TCP limits before the token can be
--- overridden (tests).
---@param options wsync.EndpointOptions
---@return wsync.Endpoint
function M.listen(options)
  local parent = options.parent or os.getenv("TMPDIR") or "/tmp"
  M.remove_leftovers(parent, options.on_refused)
  local directory, path = nil, options.path
  if path then
    M.free_path(path)
  else
    -- The directory's name carries this process's pid, so that a later host
    -- can tell the leftovers of a host that died without removing them.
    local template = string.format("%s/wsync-%d-XXXXXX", parent, uv.os_getpid())
    -- A unix socket's path has to fit sockaddr_un (107 bytes and a NUL); a
    -- longer one would be cut short silently, outside the private directory.
    local length = #(template .. "/control.sock")
    if length > M.MAX_SOCKET_PATH then
      errors.raise("ENDPOINT", string.format("the control socket's path under %s would be %d bytes; unix sockets "
        .. "take at most %d: set TMPDIR to a shorter directory", parent, length, M.MAX_SOCKET_PATH))
    end
    local message
    directory, message = uv.fs_mkdtemp(template)
    if not directory then
      errors.raise("ENDPOINT", "cannot create a private directory for the control socket: " .. tostring(message))
    end
    uv.fs_chmod(directory, tonumber("700", 8))
    path = directory .. "/control.sock"
  end
  local self = setmetatable({
    directory = directory,
    path = path,
    peers = {},
    waiting = {},      -- TCP peers that have not proved the token: {timer, why}
    waiting_count = 0,
  }, Endpoint)
  self.server = uv.new_pipe(false)
  self:_listen(self.server, self.path, function()
    self:_accept(options)
  end, self.path)
  if options.tcp then
    self:_listen_tcp(options)
  end
  return self
end

--- Makes `path` free for a control socket (a path given by the recipe): one
--- that a host which is gone left (nothing listens on it) is removed; a path
--- too long for a unix socket, in a directory that does not exist, holding
--- something other than a socket, or a socket a live host listens on is
--- refused (ENDPOINT). Must run in a coroutine of wsync.loop.spawn.
---@param path string
function M.free_path(path)
  local function refuse(why)
    errors.raise("ENDPOINT", string.format("cannot listen on %s: %s", path, why))
  end
  if #path > M.MAX_SOCKET_PATH then
    refuse(string.format("%d bytes; unix sockets take at most %d", #path, M.MAX_SOCKET_PATH))
  end
  local directory = path:match("^(.*)/[^/]*$") or "."
  local parent = uv.fs_stat(directory ~= "" and directory or "/")
  if not parent or parent.type ~= "directory" then
    refuse(string.format("its directory %s does not exist", directory))
  end
  local stat = uv.fs_lstat(path)
  if not stat then
    return
  end
  if stat.type ~= "socket" then
    refuse(string.format("a %s is there, not a socket", stat.type))
  end
  local probe = uv.new_pipe(false)
  local connected, code = loop.await(function(resume)
    probe:connect(path, function(err)
      resume(err == nil, err)
    end)
  end)
  probe:close()
  if connected then
    refuse("another host listens there")
  end
  if not tostring(code):match("ECONNREFUSED") then
    refuse(tostring(code))
  end
  local removed, message = uv.fs_unlink(path)
  if not removed then
    refuse(string.format("the socket a host that is gone left there cannot be removed: %s", tostring(message)))
  end
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

-- Binds `server` (a pipe or a TCP handle) to `...` and listens on it, calling
-- `accept` for each connection; when it cannot, closes the endpoint and
-- raises ENDPOINT naming `where`.
function Endpoint:_listen(server, where, accept, ...)
  local ok, err = server:bind(...)
  if ok then
    ok, err = server:listen(64, function(listen_error)
      if not listen_error then
        accept()
      end
    end)
  end
  if not ok then
    self:close()
    errors.raise("ENDPOINT", string.format("cannot listen on %s: %s", where, tostring(err)))
  end
end

function Endpoint:_listen_tcp(options)
  local address, port = M.parse_address(options.tcp)
  if not address then
    self:close()
    errors.raise("ENDPOINT", "control.tcp: " .. port)
  end
  self.tcp_server = uv.new_tcp()
  self:_listen(self.tcp_server, "TCP " .. options.tcp, function()
    self:_accept_tcp(options)
  end, address, port)
  local bound = self.tcp_server:getsockname()
  self.token = options.token or require("wsync.util").random_hex(16) -- (128 random bits)
  local host = bound.ip:find(":", 1, true) and ("[" .. bound.ip .. "]") or bound.ip
  --- Where a remote agent connects: "tcp://ADDRESS:PORT".
  self.tcp_address = string.format("tcp://%s:%d", host, bound.port)
  --- What a remote agent connects to: "tcp://ADDRESS:PORT?token=TOKEN".
  self.tcp_endpoint = string.format("%s?token=%s", self.tcp_address, self.token)
end

-- Reports a refusal through options.on_refused.
local function refused(options, line)
  if options.on_refused then
    options.on_refused(line)
  end
end

-- Makes an accepted connection a peer of this endpoint: admitted at once
-- (unix: its user id is checked), or gated until it proves the token (TCP).
function Endpoint:_peer(client, options, name, via)
  local gated = via == "tcp"
  local peer
  peer = peer_module.new(client, {
    name = name,
    schemas = options.schemas,
    limit = gated and (options.unauthenticated_frame_limit or M.UNAUTHENTICATED_FRAME_LIMIT) or nil,
    gate = gated and function(message)
      self:_authenticate(peer, message, options)
    end or nil,
    on_bad_request = function(cmd, reason)
      if options.on_bad_request then
        options.on_bad_request(peer, cmd, reason)
      end
    end,
    on_close = function(reason, violation)
      self.peers[peer] = nil
      local waiting = self:_stop_waiting(peer)
      if waiting then
        if not self.closed then
          refused(options, string.format("refused %s: %s", name, waiting.why or (violation
            and reason .. " before proving the token" or "it closed the connection before proving the token")))
        end
      elseif options.on_lost then
        options.on_lost(peer, reason, violation)
      end
    end,
  })
  peer.via = via
  self.peers[peer] = true
  if not gated then
    peer:admit(options.handlers_for(peer))
    return peer
  end
  local deadline = options.authentication_deadline or M.AUTHENTICATION_DEADLINE
  local waiting = {}
  self.waiting[peer] = waiting
  self.waiting_count = self.waiting_count + 1
  waiting.timer = loop.after(deadline * 1000, function()
    waiting.why = string.format("no token within %.3g s", deadline)
    peer:close(waiting.why)
  end)
  return peer
end

-- Forgets that `peer` waits to prove the token; returns what it waited
-- with, or nil when it was not waiting.
function Endpoint:_stop_waiting(peer)
  local waiting = self.waiting[peer]
  if waiting then
    self.waiting[peer] = nil
    self.waiting_count = self.waiting_count - 1
    loop.cancel(waiting.timer)
  end
  return waiting
end

-- What a gated peer sent instead of the token, for the host's line (a
-- command's name only when it looks like one: the bytes are anyone's).
local function instead_of_token(message)
  if message.ok ~= nil then
    return "an answer before the token"
  end
  local cmd = message.cmd
  if cmd == "hello" then
    return type(message.payload) == "table" and message.payload.token ~= nil and "a wrong token" or "no token"
  end
  if type(cmd) == "string" and #cmd <= 32 and cmd:match("^[%w_]+$") then
    return string.format("'%s' before the token", cmd)
  end
  return "a request before the token"
end

-- The gate of a TCP peer: a hello with the session's token lets it through
-- (answered {}), anything else is refused and ends the connection.
function Endpoint:_authenticate(peer, message, options)
  local payload = message.payload
  if message.ok == nil and message.cmd == "hello" and protocol.check_request(message) and type(payload) == "table"
    and M.token_matches(self.token, payload.token) then
    self:_stop_waiting(peer)
    peer:admit(options.handlers_for(peer))
    peer:answer(message, {})
    return
  end
  local waiting = self.waiting[peer]
  waiting.why = instead_of_token(message)
  peer:refuse(message, "UNAUTHENTICATED", M.REFUSAL, waiting.why)
end

function Endpoint:_accept_tcp(options)
  local client = uv.new_tcp()
  if not self.tcp_server:accept(client) then
    client:close()
    return
  end
  local remote = client:getpeername() or {}
  local name = string.format("agent at %s:%s", tostring(remote.ip), tostring(remote.port))
  local most = options.max_unauthenticated or M.MAX_UNAUTHENTICATED
  if self.waiting_count >= most then
    client:close()
    refused(options, string.format("refused %s: %d connections over TCP are waiting to prove the token already",
      name, most))
    return
  end
  client:nodelay(true)
  self:_peer(client, options, name, "tcp")
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
    refused(options, string.format("refused a connection from uid %s (pid %s): not this user", tostring(uid),
      tostring(pid)))
    return
  end
  local peer = self:_peer(client, options, "agent pid " .. tostring(pid), "unix")
  peer.pid = pid
end

--- Stops accepting, closes every connection and removes the socket and its
--- directory. Returns what could not be removed (M.remove_files).
---@return string[]
function Endpoint:close()
  self.closed = true
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
  if not self.directory then
    return failures
  end
  ok, message, code = uv.fs_rmdir(self.directory)
  if not ok and code ~= "ENOENT" then
    failures[#failures + 1] = string.format("cannot remove the control directory %s: %s", self.directory,
      tostring(message))
  end
  return failures
end

return M
