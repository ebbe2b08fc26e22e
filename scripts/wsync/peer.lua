--- A two-way control connection: both ends send requests and answer the
--- other's, over one framed stream (the host and a trainer agent).
---
--- A message with an `ok` field is a response, anything else a request. Each
--- end has at most one request of its own in flight and answers the other's
--- in a coroutine, one at a time. Any protocol violation, EOF or bad frame
--- ends the connection: the request in flight fails with the cause and
--- `on_close(reason)` runs once.
local channel_module = require("wsync.channel")
local errors = require("wsync.errors")
local inflight_module = require("wsync.inflight")
local loop = require("wsync.loop")
local protocol = require("wsync.protocol")

local M = {}

---@class wsync.Peer
---@field name string
---@field closed boolean
---@field cause string?
local Peer = {}
Peer.__index = Peer

--- Wraps an open stream.
---@param stream userdata
---@param options {name: string, handlers: table<string, fun(payload: table, request: table): table>?, limit: integer?, on_close: fun(reason: string)?}
---@return wsync.Peer
function M.new(stream, options)
  local self = setmetatable({
    name = options.name,
    handlers = options.handlers or {},
    on_close = options.on_close,
    closed = false,
    busy = false,
  }, Peer)
  self.channel = channel_module.new(stream, {
    limit = options.limit,
    on_message = function(message)
      self:_on_message(message)
    end,
    on_close = function(reason)
      self:_end(reason == "EOF" and (self.name .. " closed the connection") or reason)
    end,
  })
  self.inflight = inflight_module.new(self.channel)
  return self
end

function Peer:_end(reason)
  if self.closed then
    return
  end
  self.closed = true
  self.cause = reason
  self.channel:close()
  local pending = self.inflight.pending
  self.inflight:close()
  if pending and pending.resume then
    pending.resume(false, errors.new("PEER_LOST", string.format("%s: %s (during %s)", self.name, reason, pending.cmd),
      { phase = pending.cmd }))
  end
  if self.on_close then
    self.on_close(reason)
  end
end

function Peer:_on_message(message)
  if message.ok ~= nil then
    local pending, reason = self.inflight:take(message)
    if not pending then
      return self:_end(reason)
    end
    if message.ok then
      return pending.resume(true, message.result)
    end
    local remote = message.error
    local fields = { remote = true }
    for key, value in pairs(remote) do
      if key ~= "code" and key ~= "message" then
        fields[key] = value
      end
    end
    return pending.resume(false, errors.new(remote.code, remote.message, fields))
  end
  local ok, reason, code = protocol.check_request(message)
  if not ok then
    self.channel:send(protocol.failure({ id = tonumber(message.id) or 0, cmd = tostring(message.cmd) }, code, reason))
    return self:_end(reason)
  end
  if self.busy then
    return self:_end(self.name .. " sent a second request while one was being answered")
  end
  local handler = self.handlers[message.cmd]
  if not handler then
    self.channel:send(protocol.failure(message, "UNKNOWN_COMMAND",
      string.format("no handler for '%s' on this side of %s", message.cmd, self.name)))
    return
  end
  self.busy = true
  loop.spawn(handler, function(success, value)
    self.busy = false
    if self.closed then
      return
    end
    if success then
      self.channel:send(protocol.success(message, value))
      return
    end
    local fields = {}
    if errors.is(value) then
      for key, field in pairs(value) do
        if key ~= "code" and key ~= "message" and type(field) ~= "table" and type(field) ~= "function" then
          fields[key] = field
        end
      end
      self.channel:send(protocol.failure(message, value.code, value.message, fields))
    else
      self.channel:send(protocol.failure(message, "INTERNAL", tostring(value)))
    end
  end, message.payload or {}, message)
end

--- Sends a request and waits for its answer (inside a spawned coroutine).
--- Returns the result; raises the remote error object, or PEER_LOST /
--- PEER_TIMEOUT (after which the connection is closed).
---@param cmd string
---@param payload table?
---@param timeout number? seconds (default 60)
---@return table
function Peer:request(cmd, payload, timeout)
  if self.closed then
    errors.raise("PEER_LOST", string.format("%s: connection closed: %s", self.name, tostring(self.cause)),
      { phase = cmd })
  end
  local inflight = self.inflight
  if inflight.pending then
    error(string.format("%s: %s requested while %s is in flight", self.name, cmd, inflight.pending.cmd), 2)
  end
  local seconds = timeout or 60
  local pending, reason = inflight:send(cmd, payload, seconds, function()
    self:_end(string.format("timeout: no answer to %s within %.3g s", cmd, seconds))
  end)
  if not pending then
    self:_end("cannot send " .. cmd .. ": " .. reason)
    errors.raise("PEER_LOST", string.format("%s: %s", self.name, self.cause), { phase = cmd })
  end
  local ok, result = inflight:await(pending)
  if not ok then
    error(result, 2)
  end
  return result
end

--- Closes the connection (a request in flight fails with `reason`).
---@param reason string?
function Peer:close(reason)
  self:_end(reason or "closed")
end

return M
