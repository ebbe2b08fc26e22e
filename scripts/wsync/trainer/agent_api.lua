--- The agent API for trainers written in C (libwsync's ws_agent_* functions in
--- bindings/wsync.h, implemented in bindings/agent.c), and later Python via
--- ctypes: synchronous calls over wsync.trainer.agent.
---
--- The agent lives in the Lua state of the trainer's own wsync host. Each call
--- starts the agent's work in a coroutine and runs the host loop until that
--- coroutine ends (wsync.loop.run_until), so the caller blocks while the host's
--- commands (init, fill, verify, step callbacks) are served. Between calls the
--- loop does not run; the agent's connection is unref'd so that other work on
--- the same host (ws_host_run_string) still ends.
---
--- Every function returns its result, or `nil, message, STATUS` with STATUS a
--- status name of host/status_defs.h: EINVAL (a bad argument), ESTATE (a call
--- out of order, or while the loop runs, e.g. from a step callback), EFAILED
--- (the operation failed: connection, registration, publication), ELUA (a
--- bug). A failed
--- publication's message is the host's error, the same on every rank:
--- `[phase P, rank R] message (CODE, cause C)`.
---
--- The Lua binding of the agent is wsync.trainer.agent itself: Lua trainers call it
--- from coroutines on the loop (see wsync.trainer.synthetic), never this module, whose
--- calls may not run inside the loop.
local agent_module = require("wsync.trainer.agent")
local errors = require("wsync.errors")
local loop = require("wsync.loop")

local M = {}

---@class wsync.AgentHandle
---@field agent wsync.Agent
---@field rank integer
---@field state "registering"|"ready"|"broken"|"closed"
local Handle = {}
Handle.__index = Handle

local pack = require("wsync.util").pack

--- The text a C caller reads for an error value: an error object's context
--- and message with its code (and its cause, when the error carries one); a
--- Lua error (a bug) with its traceback.
---@param err any
---@return string
function M.describe(err)
  if not errors.is(err) then
    return tostring(err)
  end
  local code = err.code
  if err.cause ~= nil and err.cause ~= err.code then
    code = code .. ", cause " .. tostring(err.cause)
  end
  local text = string.format("%s (%s)", tostring(err), code)
  if err.code == "LUA_ERROR" and err.traceback then
    text = text .. "\n" .. err.traceback
  end
  return text
end

local function failure(err, status)
  if errors.is(err) and err.code == "LUA_ERROR" then
    status = "ELUA"
  elseif errors.is(err) and err.code == "LOOP_BUSY" then
    status = "ESTATE"
  end
  return nil, M.describe(err), status
end

-- A misuse caught by wsync.trainer.agent's argument checks: its message without the
-- file:line prefix that error() added (the C caller has no use for it).
local function misuse(err)
  local message = errors.is(err) and err.message or tostring(err)
  return nil, (message:gsub("^[^\n]-:%d+: ", "")), "EINVAL"
end

-- Runs fn(...) in a coroutine and the loop until it ended. Returns true and
-- fn's results, or false and the error (fn's, or the loop's).
local function run(fn, ...)
  if loop.is_running() then
    return false, errors.new("LOOP_BUSY", "the agent API waits on the loop itself: call it from outside the loop "
      .. "(Lua code on the loop uses wsync.trainer.agent)"), false
  end
  local outcome = nil
  loop.spawn(fn, function(...)
    outcome = pack(...)
  end, ...)
  local ran, err = pcall(loop.run_until, function()
    return outcome ~= nil
  end)
  if not ran then
    return false, err, outcome == nil
  end
  return unpack(outcome, 1, outcome.n)
end

-- The checks every call makes before it runs anything.
function Handle:_usable(call)
  if self.state == "closed" then
    return nil, call .. ": the agent is closed", "ESTATE"
  end
  if self.state == "broken" then
    return nil, string.format("%s: the agent is unusable after an earlier failure: %s", call, self.broken), "ESTATE"
  end
  return true
end

-- After `run` failed: when the loop itself failed with the call's coroutine
-- still waiting, the agent's state is unknown and nothing more may run.
function Handle:_after_failure(err, stranded)
  if stranded then
    self.state = "broken"
    self.broken = M.describe(err)
  end
end

---@class wsync.AgentOpenOptions
---@field endpoint string
---@field rank integer
---@field world integer
---@field backend string?
---@field device_index integer?
---@field timeout number?

--- Connects a trainer rank to the host's control endpoint.
---@param options wsync.AgentOpenOptions
---@return wsync.AgentHandle|nil, string?, string?
function M.open(options)
  local ok, agent = run(agent_module.connect, options)
  if not ok then
    return failure(agent, "EFAILED")
  end
  agent:unref()
  return setmetatable({ agent = agent, rank = options.rank, state = "registering" }, Handle)
end

--- Registers one tensor: this rank's `row_count` rows of dim 0 from
--- `first_row`, row-major at `pointer` (lightuserdata or cdata), `bytes` long.
---@return true|nil, string?, string?
function Handle:register_tensor(name, dtype, shape, pointer, bytes, first_row, row_count)
  local usable, message, status = self:_usable("register_tensor")
  if not usable then
    return nil, message, status
  end
  if self.state ~= "registering" then
    return nil, string.format("register_tensor %s: the rank registered already (ready was called)", name), "ESTATE"
  end
  if self.agent.by_name[name] then
    return nil, string.format("register_tensor %s: this rank registered that name already", name), "EINVAL"
  end
  local ok, err = pcall(self.agent.register_tensor, self.agent, {
    name = name, dtype = dtype, shape = shape, memory = { pointer = pointer, size = bytes }, offset = 0,
    rows = { first_row, row_count },
  })
  if not ok then
    return misuse(err)
  end
  return true
end

--- Tells the agent where tensor `name`'s rows live now (`pointer`, `bytes`),
--- after an offload and an onload moved them; read at the next
--- publication's start. Allowed before and after ready and inside step
--- callbacks (it runs nothing on the loop).
---@return true|nil, string?, string?
function Handle:move_tensor(name, pointer, bytes)
  local usable, message, status = self:_usable("set_tensor_data")
  if not usable then
    return nil, message, status
  end
  local ok, err = pcall(self.agent.move_tensor, self.agent, name, pointer, bytes)
  if not ok then
    return misuse(err)
  end
  return true
end

--- Registers step callback `name`. `call()` runs the trainer's callback and
--- returns its status and whether it ran to its end: a callback that did not
--- (it was interrupted before it completed), or returned non-zero, fails the
--- host's schedule step with an error naming the callback and this rank.
---@param name string
---@param call fun(): integer, boolean
---@return true|nil, string?, string?
function Handle:register_callback(name, call)
  local usable, message, status = self:_usable("register_callback")
  if not usable then
    return nil, message, status
  end
  if self.state ~= "registering" then
    return nil, string.format("register_callback %s: the rank registered already (ready was called)", name),
      "ESTATE"
  end
  local rank = self.rank
  self.agent:register_callback(name, function()
    local result, done = call()
    -- The host prefixes "trainer rank R: ".
    if not done then
      errors.raise("CALLBACK_FAILED", string.format("callback '%s' was interrupted before it completed (it did not "
        .. "report done)", name), { rank = rank, phase = "schedule" })
    elseif result ~= 0 then
      errors.raise("CALLBACK_FAILED", string.format("callback '%s' failed (it returned %d)", name, result),
        { rank = rank, phase = "schedule" })
    end
  end)
  return true
end

--- Sends the registration; returns when every rank registered and the host
--- is ready.
---@return true|nil, string?, string?
function Handle:ready()
  local usable, message, status = self:_usable("ready")
  if not usable then
    return nil, message, status
  end
  if self.state ~= "registering" then
    return nil, "ready: the rank registered already", "ESTATE"
  end
  local ok, err, stranded = run(self.agent.ready, self.agent)
  if not ok then
    self:_after_failure(err, stranded)
    return failure(err, "EFAILED")
  end
  self.state = "ready"
  return true
end

--- Joins a collective publication of trainer step `step` (nil: the host's
--- next model version). Returns {model_version, publication_id, manifest,
--- receipts}.
---@param step integer?
---@return table|nil, string?, string?
function Handle:publish(step)
  local usable, message, status = self:_usable("publish")
  if not usable then
    return nil, message, status
  end
  if self.state ~= "ready" then
    return nil, "publish: call ready first", "ESTATE"
  end
  local ok, result, stranded = run(self.agent.publish, self.agent, step)
  if not ok then
    self:_after_failure(result, stranded)
    return failure(result, "EFAILED")
  end
  return {
    model_version = result.model_version,
    publication_id = result.publication_id,
    manifest = result.manifest,
    receipts = result.receipts,
  }
end

--- Leaves the host (the socket is closed at once; libuv's close callbacks
--- run at the loop's next turn) and unmaps and frees every buffer the agent
--- mapped. Safe to call twice.
function Handle:close()
  if self.state == "closed" then
    return true
  end
  self.state = "closed"
  self.agent:close()
  return true
end

return M
