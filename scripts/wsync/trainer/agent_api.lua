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
--- A trainer may set an interrupt check (ws_agent_set_interrupt_check), which
--- ready and publish call every CHECK_INTERVAL_MS while they wait on the loop:
--- one that does not complete (a Python check unwound by Ctrl-C) abandons the
--- call fail-stop (Handle:_abandon).
---
--- The Lua binding of the agent is wsync.trainer.agent itself: Lua trainers call it
--- from coroutines on the loop (see wsync.trainer.synthetic), never this module, whose
--- calls may not run inside the loop.
local agent_module = require("wsync.trainer.agent")
local errors = require("wsync.errors")
local loop = require("wsync.loop")

local M = {}

--- How often a waiting call runs the trainer's interrupt check, in ms.
M.CHECK_INTERVAL_MS = 100

---@class wsync.AgentHandle
---@field agent wsync.Agent
---@field rank integer
---@field endpoint string
---@field state "registering"|"ready"|"broken"|"closed"
---@field check (fun(): boolean)? the trainer's interrupt check: true when it completed
---@field left boolean? the agent left its host already (an abandoned call)
local Handle = {}
Handle.__index = Handle

-- What stops a session of this process's own host when a call of an agent on
-- its endpoint is abandoned (wsync.cli.embedded sets it), or nil.
local abandon_handler = nil

local util = require("wsync.util")

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

-- Runs fn(...) in a coroutine and the loop until it ended, calling `check()`
-- (when given) every CHECK_INTERVAL_MS meanwhile. Returns true and fn's
-- results, or false, the error (fn's, or the loop's) and whether fn's
-- coroutine was left waiting; the error is INTERRUPTED, with `interrupted`
-- set, when the check did not complete.
local function run(check, fn, ...)
  if loop.is_running() then
    return false, errors.new("LOOP_BUSY", "the agent API waits on the loop itself: call it from outside the loop "
      .. "(Lua code on the loop uses wsync.trainer.agent)"), false
  end
  local outcome, interrupted = nil, false
  loop.spawn(fn, function(...)
    outcome = util.pack(...)
  end, ...)
  local timer = check and loop.every(M.CHECK_INTERVAL_MS, function()
    if outcome == nil and not interrupted and not check() then
      interrupted = true
    end
  end)
  local ran, err = pcall(loop.run_until, function()
    return outcome ~= nil or interrupted
  end)
  loop.cancel(timer)
  if outcome == nil and interrupted then
    return false, errors.new("INTERRUPTED", "the trainer's interrupt check did not complete", { interrupted = true }),
      true
  end
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

-- Runs the agent's method `method` (with `...`) at once, for API call `call`
-- (which names it in a refusal): true, or nil, message, status when the
-- handle is unusable or the agent's checks reject the arguments.
function Handle:_call(call, method, ...)
  local usable, message, status = self:_usable(call)
  if not usable then
    return nil, message, status
  end
  local ok, err = pcall(self.agent[method], self.agent, ...)
  if not ok then
    return misuse(err)
  end
  return true
end

-- Runs the agent's method `call` (with `...`) under the interrupt check, in
-- state `state` only (else refused with `refusal`). Returns true and the
-- method's result, or nil, message, status.
function Handle:_wait_for(call, state, refusal, ...)
  local usable, message, status = self:_usable(call)
  if not usable then
    return nil, message, status
  end
  if self.state ~= state then
    return nil, refusal, "ESTATE"
  end
  local ok, result, stranded = run(self.check, self.agent[call], self.agent, ...)
  if not ok then
    return failure(self:_after_failure(result, stranded, call), "EFAILED")
  end
  return true, result
end

-- After `run` failed: when the loop itself failed with the call's coroutine
-- still waiting, the agent's state is unknown and nothing more may run; an
-- interrupted call is abandoned. Returns the error to report.
function Handle:_after_failure(err, stranded, call)
  if errors.is(err) and err.interrupted then
    err = self:_abandon(call)
  end
  if stranded then
    self.state = "broken"
    self.broken = M.describe(err)
  end
  return err
end

-- Abandons `call`, which its interrupt check interrupted, fail-stop: a session
-- this process's host runs on the agent's endpoint is stopped (as closing the
-- host stops it), and the rank leaves its host. Returns the error to report.
function Handle:_abandon(call)
  local stopped = ""
  if abandon_handler then
    local ok, result = pcall(abandon_handler, self.endpoint)
    if not ok then
      stopped = "; stopping this host's session failed: " .. M.describe(result)
    elseif result then
      stopped = "; this host's session was stopped"
    end
  end
  self.left = true
  self.agent:close()
  return errors.new("INTERRUPTED", string.format("%s was interrupted (the trainer's interrupt check did not "
    .. "complete): the call was abandoned and this rank left its host%s", call, stopped), { rank = self.rank })
end

--- Sets what an abandoned call runs, with the agent's endpoint, before the
--- rank leaves: wsync.cli.embedded stops its session when the endpoint is
--- its own and returns whether it did. nil removes it.
---@param handler (fun(endpoint: string): boolean)?
function M.set_abandon_handler(handler)
  abandon_handler = handler
end

---@class wsync.AgentOpenOptions
---@field endpoint string?  default: $WSYNC_ENDPOINT
---@field rank integer
---@field world integer
---@field backend string?
---@field device_index integer?
---@field timeout number?

--- Connects a trainer rank to the host's control endpoint.
---@param options wsync.AgentOpenOptions
---@return wsync.AgentHandle|nil, string?, string?
function M.open(options)
  local ok, agent = run(nil, agent_module.connect, options)
  if not ok then
    return failure(agent, "EFAILED")
  end
  agent:unref()
  return setmetatable({ agent = agent, rank = options.rank, endpoint = agent.endpoint, state = "registering" },
    Handle)
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
  return self:_call("set_tensor_data", "move_tensor", name, pointer, bytes)
end

--- Records what the step callback running now moved (ws_agent_report_moved).
---@param bytes number
---@return true|nil, string?, string?
function Handle:report_moved(bytes)
  return self:_call("report_moved", "report_moved", bytes)
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

--- Sets the interrupt check: `call()` runs the trainer's check and returns
--- its status and whether it ran to its end; ready and publish call it every
--- CHECK_INTERVAL_MS while they wait, and abandon themselves when it did not
--- complete (status non-zero, or not done). nil removes it.
---@param call (fun(): integer, boolean)?
---@return true|nil, string?, string?
function Handle:set_interrupt_check(call)
  local usable, message, status = self:_usable("set_interrupt_check")
  if not usable then
    return nil, message, status
  end
  self.check = call and function()
    local result, done = call()
    return result == 0 and done
  end or nil
  return true
end

--- Sends the registration; returns when every rank registered and the host
--- is ready.
---@return true|nil, string?, string?
function Handle:ready()
  local ok, message, status = self:_wait_for("ready", "registering", "ready: the rank registered already")
  if not ok then
    return nil, message, status
  end
  self.state = "ready"
  return true
end

--- Joins a collective publication of trainer step `step` (nil: the host's
--- next model version). Returns the host's answer, {model_version,
--- publication_id, manifest, receipts, report, generation}: `report` the
--- round's report as JSON (wsync.publish.report.round_json; "" from a host
--- that sends none).
--- `generate_json` (JSON text {prompts, sampling}, or nil): what the
--- schedule's "generate" step generates for this rank with the weights just
--- published; `generation` is then its answer as JSON text ({model_version,
--- outputs}; "" otherwise).
---@param step integer?
---@param generate_json string?
---@return table|nil, string?, string?
function Handle:publish(step, generate_json)
  local generate
  if generate_json ~= nil then
    local decoded, value = pcall(require("cjson").decode, generate_json)
    if not decoded or type(value) ~= "table" then
      return nil, "publish: the generation request is not a JSON object: " .. tostring(generate_json):sub(1, 80),
        "EINVAL"
    end
    generate = value
  end
  local ok, result, status = self:_wait_for("publish", "ready", "publish: call ready first", step, generate)
  if not ok then
    return nil, result, status
  end
  return util.merged({ report = "", generation = "" }, result)
end

--- Leaves the host (the socket is closed at once; libuv's close callbacks
--- run at the loop's next turn) and unmaps and frees every buffer the agent
--- mapped. Safe to call twice.
function Handle:close()
  if self.state == "closed" then
    return true
  end
  self.state = "closed"
  if not self.left then
    self.agent:close()
  end
  return true
end

return M
