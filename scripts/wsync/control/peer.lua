--- A two-way control connection: both ends send requests and answer the
--- other's, over one framed stream (the host and a trainer agent).
---
--- A message with an `ok` field is a response, anything else a request. Each
--- end has at most one request of its own in flight and answers the other's
--- in a coroutine, one at a time. Any protocol violation, EOF or bad frame
--- ends the connection: the request in flight fails with the cause and
--- `on_close(reason, violation)` runs once (`violation`: the other end broke
--- the protocol: a bad frame, a malformed message, a second request).
---
--- A peer made with a `gate` is gated: every message the other end sends
--- goes to `gate(message)` and nowhere else until the gate lets it through
--- (`admit`: handlers and a frame limit from then on) or turns it away
--- (`refuse`: one answer, then the connection ends). wsync.control.endpoint
--- gates TCP connections until they prove the session's token.
---
--- `schemas` (wsync.control.messages) gives the shape of every request payload this
--- end answers and of every result it waits for: a request whose payload does
--- not fit is answered with a BAD_MESSAGE error naming the field (then
--- `on_bad_request(cmd, reason)` decides what else happens), a result that
--- does not fit fails its request with BAD_MESSAGE.
local channel_module = require("wsync.control.channel")
local errors = require("wsync.errors")
local inflight_module = require("wsync.control.inflight")
local loop = require("wsync.loop")
local messages = require("wsync.control.messages")
local protocol = require("wsync.control.protocol")
local util = require("wsync.util")

local M = {}

---@class wsync.Peer
---@field name string
---@field closed boolean
---@field cause string?
local Peer = {}
Peer.__index = Peer

---@class wsync.PeerOptions
---@field name string
---@field handlers table<string, fun(payload: table, request: table): table>?
---@field limit integer?
---@field on_close fun(reason: string, violation: boolean)?
---@field schemas {requests: table, results: table}?
---@field on_bad_request fun(cmd: string, reason: string)?
---@field gate fun(message: table)?  while set, receives every message instead of the handlers

--- Wraps an open stream.
---@param stream userdata
---@param options wsync.PeerOptions
---@return wsync.Peer
function M.new(stream, options)
  local schemas = options.schemas or {}
  local self = setmetatable({
    name = options.name,
    handlers = options.handlers or {},
    on_close = options.on_close,
    on_bad_request = options.on_bad_request,
    gate = options.gate,
    request_schemas = schemas.requests or {},
    result_schemas = schemas.results or {},
    closed = false,
    busy = false,
  }, Peer)
  self.channel = channel_module.new(stream, {
    limit = options.limit,
    on_message = util.bind(self, Peer._on_message),
    on_close = function(reason)
      if reason == "EOF" then
        self:_end(self.name .. " closed the connection")
      else
        self:_end(reason, not reason:match("^read error"))
      end
    end,
  })
  self.inflight = inflight_module.new(self.channel)
  return self
end

--- Calls `on_slow(cmd, seconds, deadline)` while a request of this end
--- waits for the other's answer: after 5 s, then each time the wait doubled
--- (wsync.control.inflight's watch). From a libuv callback: it must not raise.
---@param on_slow fun(cmd: string, seconds: number, deadline: number)
function Peer:watch(on_slow)
  self.inflight:watch(function(pending, seconds)
    on_slow(pending.cmd, seconds, pending.seconds)
  end)
end

function Peer:_end(reason, violation)
  if self.closed then
    return
  end
  self.closed = true
  self.cause = reason
  self.violation = violation == true
  self.channel:close()
  local pending = self.inflight.pending
  self.inflight:close()
  if pending and pending.resume then
    pending.resume(false, errors.new("PEER_LOST", string.format("%s: %s (during %s)", self.name, reason, pending.cmd),
      { phase = pending.cmd }))
  end
  if self.on_close then
    self.on_close(reason, self.violation)
  end
end

function Peer:_on_message(message)
  if self.gate then
    return self.gate(message)
  end
  if message.ok ~= nil then
    local pending, reason = self.inflight:take(message)
    if not pending then
      return self:_end(reason, true)
    end
    if message.ok then
      local result, bad = messages.check(self.result_schemas, pending.cmd, message.result)
      if bad then
        return pending.resume(false, errors.new("BAD_MESSAGE", string.format("%s answered %s", self.name, bad),
          { phase = pending.cmd }))
      end
      return pending.resume(true, result)
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
    self.channel:send(protocol.refusal(message, code, reason))
    return self:_end(reason, true)
  end
  if self.busy then
    return self:_end(self.name .. " sent a second request while one was being answered", true)
  end
  local handler = self.handlers[message.cmd]
  if not handler then
    self.channel:send(protocol.failure(message, "UNKNOWN_COMMAND",
      string.format("no handler for '%s' on this side of %s", message.cmd, self.name)))
    return
  end
  local payload, bad = messages.check(self.request_schemas, message.cmd, message.payload or {})
  if bad then
    self.channel:send(protocol.failure(message, "BAD_MESSAGE", bad))
    if self.on_bad_request then
      self.on_bad_request(message.cmd, bad)
    end
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
    elseif errors.is(value) then
      local fields = errors.fields(value)
      fields.code, fields.message = nil, nil
      self.channel:send(protocol.failure(message, value.code, value.message, fields))
    else
      self.channel:send(protocol.failure(message, "INTERNAL", tostring(value)))
    end
  end, payload, message)
end

--- Lets the peer's requests through to `handlers` from now on, with frames up
--- to `limit` bytes (default wsync.control.protocol.MAX_FRAME); a gated peer's
--- gate is gone then.
---@param handlers table<string, fun(payload: table, request: table): table>
---@param limit integer?
function Peer:admit(handlers, limit)
  self.gate = nil
  self.handlers = handlers
  self.channel:set_limit(limit or protocol.MAX_FRAME)
end

--- Answers `request` with `result` (for a gate, which answers by itself).
---@param request table
---@param result table?
function Peer:answer(request, result)
  self.channel:send(protocol.success(request, result))
end

--- Answers `message` (whatever it is) with the error `code`, `text` and
--- nothing else, and ends the connection: nothing more is read, the stream
--- closes once the answer is written, and on_close runs now with `reason`,
--- as a violation.
---@param message table
---@param code string
---@param text string
---@param reason string
function Peer:refuse(message, code, text, reason)
  if self.closed then
    return
  end
  self.channel:send_last(protocol.refusal(message, code, text))
  self:_end(reason, true)
end

--- Sends a request and waits for its answer (inside a spawned coroutine).
--- Returns the result; raises the remote error object, or PEER_LOST when the
--- connection ended first, a timeout included ("timeout: no answer to CMD
--- within N s": the connection is closed then).
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
