--- The serving end of the control protocol, used by every process the host
--- spawns (the runtime's main process and its TP workers): reads requests from
--- an inherited channel, runs one handler at a time in a coroutine, answers.
local uv = require("luv")
local channel_module = require("wsync.control.channel")
local errors = require("wsync.errors")
local fault_module = require("wsync.control.fault")
local loop = require("wsync.loop")
local protocol = require("wsync.control.protocol")
local util = require("wsync.util")

local M = {}

--- The commands a request may carry folded into it, by payload field.
local FOLDED = { start = "start_update", finish = "finish_update" }

--- How long a server polls without sleeping after each answer, by default
--- ($WSYNC_SERVER_SPIN_US overrides; 0 turns it off). A server whose peer
--- talks to several such servers at once (the TP workers of one runtime)
--- passes `spin_us = 0`: servers spinning together would take every core
--- from the process that waits for their answers (measured on 2 CPUs: a
--- broadcast to two spinning workers took 1.1 ms, 0.11 ms without).
M.SPIN_MICROSECONDS = tonumber(os.getenv("WSYNC_SERVER_SPIN_US") or "") or (loop.SPARE_CORES and 500 or 0)

---@class wsync.ServerOptions
---@field fd integer?
---@field name string
---@field handlers table<string, fun(payload: table, request: table): table>
---@field fault string|table|nil
---@field limit integer?
---@field on_close fun(reason: string)?
---@field spin_us number?  polling after each answer (default M.SPIN_MICROSECONDS)

---@class wsync.Server
---@field channel wsync.Channel
---@field busy boolean
local Server = {}
Server.__index = Server

-- Misbehaves as the fault kind says. Returns true when the request must get no
-- normal answer.
function Server:_inject(kind, request)
  local channel = self.channel
  if kind == "crash" then
    uv.kill(uv.os_getpid(), "sigkill")
    return true
  elseif kind == "hang" then
    return true
  elseif kind == "stop" then
    uv.kill(uv.os_getpid(), "sigstop") -- stopped, not dead: only SIGKILL ends it
    return true
  elseif kind == "stubborn" then
    self.ignore_term = uv.new_signal()
    self.ignore_term:start("sigterm", function() end)
    return true
  elseif kind == "eof" then
    channel:close()
    return true
  elseif kind == "garbage" then
    channel:send_raw("\0\0\0\12{{not json}}")
    return true
  elseif kind == "oversize" then
    local length = channel.limit + 1
    channel:send_raw(string.char(math.floor(length / 16777216) % 256, math.floor(length / 65536) % 256,
      math.floor(length / 256) % 256, length % 256) .. "{")
    return true
  elseif kind == "error" then
    channel:send(protocol.failure(request, "INJECTED", "injected failure of " .. request.cmd))
    return true
  end
  return false -- wrong_id, wrong_cmd, wrong_protocol, bad_result alter the answer
end

local function alter(kind, response)
  if kind == "wrong_id" then
    response.id = response.id + 1000
  elseif kind == "wrong_cmd" then
    response.cmd = "not_" .. response.cmd
  elseif kind == "wrong_protocol" then
    response.protocol = protocol.VERSION + 1
  elseif kind == "bad_result" then
    response.result = "not an object"
  end
  return response
end

function Server:_answer(request, ok, value, kind)
  local response
  if ok then
    response = protocol.success(request, value)
  elseif errors.is(value) then
    -- A plain Lua error in a handler is a bug: the process's state is no
    -- longer known, so it is fatal (with its traceback). `rank`: the TP
    -- worker that failed, when a worker did.
    local bug = value.code == "LUA_ERROR"
    response = protocol.failure(request, value.code, value.message, {
      fatal = (value.fatal or bug) or nil,
      rank = value.rank,
      traceback = bug and value.traceback or nil,
    })
  else
    response = protocol.failure(request, "INTERNAL", tostring(value.message or value), {
      traceback = type(value) == "table" and value.traceback or nil,
      fatal = true,
    })
  end
  local sent, reason = self.channel:send(alter(kind, response))
  local spin = self.spin_us or M.SPIN_MICROSECONDS
  if spin > 0 then
    loop.spin(spin) -- the next request of a burst arrives awake
  end
  if not sent then
    io.stderr:write(string.format("%s: cannot answer %s: %s\n", self.name, request.cmd, reason))
  end
end

function Server:_on_message(request)
  local ok, reason, code = protocol.check_request(request)
  if not ok then
    local reply = protocol.refusal(request, code, reason, { fatal = true })
    self.channel:send(reply)
    if code == "PROTOCOL_MISMATCH" then
      -- The connection ends here: the process goes down as when its peer
      -- goes away (the main process takes its workers down with it).
      self:close_after_flush()
      if self.on_close then
        self.on_close(reason)
      end
    end
    return
  end
  if self.busy then
    self.channel:send(protocol.failure(request, "BUSY", "a request is already in flight", { fatal = true }))
    return
  end
  local kind = fault_module.take(self.faults, request.cmd)
  -- (A request that carries another command folded into it, as a TP
  -- worker's first and last load_chunk carry its start_update and
  -- finish_update (wsync.runtime.worker), meets that command's faults too.)
  local payload = type(request.payload) == "table" and request.payload or {}
  for field, folded in pairs(FOLDED) do
    if payload[field] ~= nil then
      kind = fault_module.take(self.faults, folded) or kind
    end
  end
  if kind and self:_inject(kind, request) then
    return
  end
  local handler = self.handlers[request.cmd]
  if not handler then
    self:_answer(request, false, errors.new("UNKNOWN_COMMAND",
      string.format("%s does not know the command '%s'", self.name, request.cmd)), kind)
    return
  end
  self.busy = true
  loop.spawn(handler, function(success, value)
    self.busy = false
    self:_answer(request, success, value, kind)
    if success and self.after_answer then
      local after = self.after_answer
      self.after_answer = nil
      after()
    end
  end, request.payload or {}, request)
end

--- Closes the channel once everything written so far has been flushed.
function Server:close_after_flush()
  local stream = self.channel.stream
  self.channel.closed = true
  if stream:is_closing() then
    return
  end
  stream:read_stop()
  stream:shutdown(function()
    if not stream:is_closing() then
      stream:close()
    end
  end)
end

--- Stops serving: closes the channel and any handle the server opened.
function Server:close()
  self.channel:close()
  if self.ignore_term and not self.ignore_term:is_closing() then
    self.ignore_term:close()
  end
end

--- Serves requests on inherited file descriptor `options.fd` (default 3).
--- `fault` is a spec string or a table parsed by wsync.control.fault.
---@param options wsync.ServerOptions
---@return wsync.Server
function M.serve(options)
  local self = setmetatable({
    name = options.name,
    handlers = options.handlers,
    faults = type(options.fault) == "table" and options.fault or fault_module.parse(options.fault),
    busy = false,
    on_close = options.on_close,
    spin_us = options.spin_us,
  }, Server)
  local pipe = uv.new_pipe(false)
  local ok, err = pipe:open(options.fd or 3)
  if not ok then
    pipe:close()
    errors.raise("RUNTIME_START", string.format("%s: no control channel on fd %d: %s", self.name,
      options.fd or 3, tostring(err)))
  end
  self.channel = channel_module.new(pipe, {
    limit = options.limit,
    on_message = util.bind(self, Server._on_message),
    on_close = function(reason)
      if options.on_close then
        options.on_close(reason)
      end
    end,
  })
  return self
end

return M
