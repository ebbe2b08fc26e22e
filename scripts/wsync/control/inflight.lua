--- The one request in flight on a control channel: request ids, the timer
--- for its answer, matching a response to it, and waking the coroutine that
--- waits for it. wsync.control.peer (host <-> agent) and wsync.control.client (host
--- -> runtime) keep their connection states on top of it; what a failure
--- does to the connection is theirs to decide.
local uv = require("luv")
local loop = require("wsync.loop")
local protocol = require("wsync.control.protocol")

local M = {}

---@class wsync.Pending
---@field id integer
---@field cmd string
---@field seconds number  how long it may wait for its answer
---@field resume fun(ok: boolean, value: any)?

---@class wsync.Inflight
---@field pending wsync.Pending? the request waiting for its answer
local Inflight = {}
Inflight.__index = Inflight

---@param channel wsync.Channel
---@return wsync.Inflight
function M.new(channel)
  return setmetatable({ channel = channel, next_id = 1 }, Inflight)
end

--- Sends request `cmd` and arms its timer: `on_timeout(pending)` runs if no
--- answer comes within `seconds`. Returns the pending request, or nil and why
--- it could not be sent. The caller checks first that none is in flight.
---@param cmd string
---@param payload table?
---@param seconds number
---@param on_timeout fun(pending: wsync.Pending)
---@return wsync.Pending?, string?
function Inflight:send(cmd, payload, seconds, on_timeout)
  assert(self.pending == nil, "a request is already in flight")
  local id = self.next_id
  self.next_id = id + 1
  local sent, reason = self.channel:send(protocol.request(id, cmd, payload))
  if not sent then
    return nil, reason
  end
  local pending = { id = id, cmd = cmd, seconds = seconds }
  self.pending = pending
  if self.on_slow then
    self.progress = loop.progress(function(waited)
      self.on_slow(pending, waited)
    end)
  end
  self.timer = self.timer or uv.new_timer() -- one timer, re-armed per request
  -- (libuv times timers from the time cached at the loop's last tick, stale
  -- after a long callback: the timeout counts from now.)
  uv.update_time()
  self.timer:start(math.floor(seconds * 1000), 0, function()
    on_timeout(pending)
  end)
  return pending
end

--- Calls `on_slow(pending, seconds)` while a request waits for its answer
--- (wsync.loop.progress: after 5 s, then each time the wait doubled), so
--- that its owner can say what it waits for; nil stops. From a libuv
--- callback: it must not raise.
---@param on_slow fun(pending: wsync.Pending, seconds: number)?
function Inflight:watch(on_slow)
  self.on_slow = on_slow
end

--- Waits, inside a coroutine of wsync.loop.spawn, until `pending` is resumed
--- (by the owner, with the answer or a failure); returns what it was resumed
--- with: true and the result, or false and an error.
---@param pending wsync.Pending
function Inflight:await(pending)
  return loop.await(function(resume)
    pending.resume = resume
  end)
end

--- Takes `message` (a response) as the answer to the request in flight:
--- checks its protocol, id, cmd and shape against the request and, when it
--- fits, ends the request's bookkeeping. Returns the pending request, or nil
--- and why the message is not a valid answer (the request stays in flight).
---@param message table
---@return wsync.Pending?, string?
function Inflight:take(message)
  local pending = self.pending
  if not pending then
    return nil, "unsolicited response " .. tostring(message.cmd)
  end
  local ok, reason = protocol.check_response(message, pending.id, pending.cmd)
  if not ok then
    return nil, reason
  end
  self:settle()
  return pending
end

--- Ends the bookkeeping of the request in flight (not its caller's wait).
function Inflight:settle()
  if self.timer then
    self.timer:stop()
  end
  loop.cancel(self.progress)
  self.progress = nil
  self.pending = nil
end

--- Settles and closes the timer. The owner resumes any waiting caller.
function Inflight:close()
  loop.cancel(self.progress)
  self.progress = nil
  self.pending = nil
  if self.timer and not self.timer:is_closing() then
    self.timer:close()
  end
  self.timer = nil
end

return M
