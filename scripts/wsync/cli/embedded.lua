--- A model recipe's session inside an embedding host (ws_host_start_recipe and
--- ws_host_finish_recipe of bindings/wsync.h; Python's wsync.Host(recipe)): for
--- a single-process trainer whose ranks are agents of the same host. The
--- session runs in a coroutine on the host's loop, which runs only inside the
--- host's calls: `start` returns once the control endpoint listens, the
--- agents' calls then drive the session, and `finish` runs the loop until the
--- session ended. The process's signals stay the trainer's: no SIGINT or
--- SIGTERM handler is installed; an agent call that the trainer's interrupt
--- check abandons (wsync.trainer.agent_api) stops the session fail-stop.
local errors = require("wsync.errors")
local loop = require("wsync.loop")

local M = {}

--- How long closing a host waits for the killed runtime's tree to be reaped.
M.ABORT_WAIT_MS = 5000

-- The host's one started session: {session?, endpoint?, done, ok, result}.
local started = nil

--- Loads, checks and starts the recipe at `path` with `key=value` overrides;
--- returns the control endpoint's path once it listens.
---@param path string
---@param words string[]
---@return string
function M.start_recipe(path, words)
  if started and not started.done then
    errors.raise("HOST_BUSY", "a recipe's session runs on this host already (finish it first)")
  end
  local recipe_module = require("wsync.recipe")
  local recipe = recipe_module.load(path, recipe_module.parse_overrides(words or {}))
  recipe_module.check(recipe)
  if not recipe.model or recipe.trainer.kind ~= "external" then
    errors.raise("RECIPE_INVALID", string.format("%s: an in-process host runs a model recipe whose trainer kind is "
      .. "\"external\" (its ranks are this process's agents); this one's is %s", path,
      recipe.model and ("\"" .. tostring(recipe.trainer.kind) .. "\"") or "not a model recipe"),
      { field = "trainer.kind" })
  end
  local state = { done = false }
  started = state
  require("wsync.trainer.agent_api").set_abandon_handler(M.interrupt)
  loop.spawn(function()
    return require("wsync.publish.session").run(recipe, {
      signals = false,
      on_open = function(session)
        state.session = session
      end,
      on_listen = function(endpoint_path)
        state.endpoint = endpoint_path
      end,
    })
  end, function(ok, result)
    state.done, state.ok, state.result = true, ok, result
  end)
  loop.run_until(function()
    return state.endpoint ~= nil or state.done
  end)
  if state.done and not state.ok then
    error(state.result, 0)
  end
  return state.endpoint
end

--- Runs the loop until the started session ended; raises its failure.
function M.finish_recipe()
  if not started then
    errors.raise("HOST_IDLE", "no recipe's session was started on this host")
  end
  local state = started
  if not state.done then
    loop.run_until(function()
      return state.done
    end)
  end
  started = nil
  if not state.ok then
    error(state.result, 0)
  end
  return 0
end

-- Stops the running session of `state` fail-stop for `reason` (the runtime's
-- process group killed, packed buffers and the endpoint removed; nothing
-- more is published).
local function stop(state, reason)
  if state.session then
    require("wsync.publish.session").abort(state.session, reason)
    -- Unlike `wsync run`, this process goes on: reap the killed runtime's
    -- tree (its client collects the group once the main process exited),
    -- for at most ABORT_WAIT_MS.
    local clients = state.session.rollout and state.session.rollout:clients() or {}
    local function all_dead()
      for _, client in ipairs(clients) do
        if not client.dead then
          return false
        end
      end
      return true
    end
    if not all_dead() and not loop.is_running() then
      local expired = false
      local timer = loop.after(M.ABORT_WAIT_MS, function()
        expired = true
      end)
      pcall(loop.run_until, function()
        return all_dead() or expired
      end)
      loop.cancel(timer)
      for _, client in ipairs(clients) do
        if not client.dead then
          io.stderr:write(string.format("wsync: the runtime's process group %s was not gone %d ms after SIGKILL\n",
            tostring(client.group), M.ABORT_WAIT_MS))
        end
      end
    end
  end
end

--- When the host closes with its session still running: stops it fail-stop.
function M.abort()
  local state = started
  started = nil
  if state and not state.done then
    stop(state, "host closed")
  end
end

--- When an agent call on `endpoint` was interrupted and abandoned: stops the
--- session fail-stop if it is this host's running session on that endpoint
--- (finish then raises INTERRUPTED). Returns whether it stopped it.
---@param endpoint string
---@return boolean
function M.interrupt(endpoint)
  local state = started
  if not state or state.done or state.endpoint ~= endpoint then
    return false
  end
  stop(state, "interrupted")
  -- (What the stopped session's coroutine ends with goes to the old state:
  -- finish raises this.)
  started = { done = true, ok = false, result = errors.new("INTERRUPTED", "the session was stopped: a trainer call "
    .. "was interrupted") }
  return true
end

--- The commands a trainer may send the started session's rollout runtime
--- itself, between its publications (submit and poll stream; the schedule's
--- pause and resume hold streaming requests across a publication).
M.ROLLOUT_COMMANDS = { generate = true, info = true, submit = true, poll = true }

--- Sends the started session's rollout runtime `cmd` with `payload` and runs
--- the loop until it answers; returns the result as JSON. For a single-process
--- trainer that generates through the runtime its weights are published into
--- (Python's wsync.Host.generate). Between publications only: the runtime
--- answers one request at a time.
---@param cmd string
---@param payload table
---@return string
function M.rollout(cmd, payload)
  local cjson = require("cjson")
  if not M.ROLLOUT_COMMANDS[cmd] then
    errors.raise("INVALID_ARGUMENT", string.format("the rollout runtime's %s is not for trainers (they may send: "
      .. "generate, info, submit, poll)", tostring(cmd)))
  end
  local state = started
  if not state or state.done then
    errors.raise("HOST_IDLE", "no recipe's session runs on this host")
  end
  local rollout = state.session and state.session.rollout
  if not rollout then
    errors.raise("STATE_REFUSED", "the session's runtime has not started yet (it starts once every trainer rank "
      .. "registered)")
  end
  local done, ok, result = false, nil, nil
  loop.spawn(function()
    return rollout:request(cmd, payload)
  end, function(finished, value)
    done, ok, result = true, finished, value
  end)
  loop.run_until(function()
    return done
  end)
  if not ok then
    error(result, 0)
  end
  return cjson.encode(result)
end

--- The started session's rounds so far (the newest it keeps), FAILED ones
--- included, as JSON with sorted keys: the run report's rounds
--- (wsync.publish.report.round_json: steps, timings, receipts, outcome).
---@return string
function M.reports()
  local state = started
  local session = state and state.session
  local report_module, util = require("wsync.publish.report"), require("wsync.util")
  local out = util.json_array({})
  for index, round in ipairs(session and session.reports or {}) do
    out[index] = report_module.round_json(round)
  end
  return util.json(out)
end

--- Runs a Lua chunk outside the loop (it must not wait on it) and returns
--- what it returned as a string (ws_host_eval).
---@param code string
---@return string
function M.eval(code)
  local chunk, message = loadstring(code, "=(eval)")
  if not chunk then
    errors.raise("SCRIPT_INVALID", message)
  end
  local result = chunk()
  return result == nil and "" or tostring(result)
end

--- The trainer tensors a model recipe expects from its ranks, in layout
--- order, as JSON: [{name, dtype, shape}] (global shapes: each rank registers
--- its rows of dim 0).
---@param path string
---@param words string[]?
---@return string
function M.trainer_tensors(path, words)
  local recipe_module = require("wsync.recipe")
  local recipe = recipe_module.load(path, recipe_module.parse_overrides(words or {}))
  if not recipe.model then
    errors.raise("RECIPE_INVALID", path .. ": not a model recipe (it has no model)", { field = "model" })
  end
  local plan = require("wsync.recipe.prepare").prepare(recipe, { plan_only = true })
  local out = {}
  for index, tensor in ipairs(plan.layout) do
    out[index] = { name = tensor.name, dtype = tensor.dtype, shape = tensor.shape }
  end
  return require("cjson").encode(out)
end

--- The calls an embedding program makes with JSON in and JSON out
--- (ws_host_call): name -> function(args table) -> the result as JSON text
--- (each encodes its own: the run report's rounds keep their empty arrays).
--- Each is a function of wsync's own; no Lua text crosses the seam.
M.CALLS = {
  --- {recipe, overrides?: ["key=value"...]} -> [{name, dtype, shape}]
  trainer_tensors = function(args)
    return M.trainer_tensors(args.recipe, args.overrides)
  end,
  --- {recipe, overrides?} -> {name, backend, runtime = {kind, tp, load?, vllm?},
  --- model_dir?}: what a trainer or a benchmark reads of a recipe (model_dir:
  --- the directory the vllm runtime serves).
  recipe = function(args)
    local recipe_module = require("wsync.recipe")
    local recipe = recipe_module.load(args.recipe, recipe_module.parse_overrides(args.overrides or {}))
    local runtime = recipe.runtime or {}
    local summary = { name = recipe.name, backend = recipe.backend, runtime = { kind = runtime.kind, tp = runtime.tp,
      load = runtime.load, vllm = runtime.vllm } }
    if runtime.kind == "vllm" then
      summary.model_dir = require("wsync.runtime.vllm").model_dir(recipe)
    end
    return require("cjson").encode(summary)
  end,
  --- {} -> the started session's rounds (M.reports).
  reports = function()
    return M.reports()
  end,
  --- {cmd, payload} -> the rollout runtime's answer (M.rollout).
  rollout = function(args)
    return M.rollout(args.cmd, args.payload or {})
  end,
  --- {family, config, world, rank, quantization?} -> {residents = [[name,
  --- dtype, shape, bytes]...], writes = {canonical = [resident...]}}: one TP
  --- rank's loader plan (wsync.plan's family module; under the rollout's
  --- quantization, the scales among the residents), as an engine's worker
  --- lists it.
  loader_plan = function(args)
    local family = require("wsync.plan").family(args.family)
    local plan = family.loader_plan(family.config(args.config), args.world, args.rank, args.quantization)
    local residents, writes = {}, {}
    for index, tensor in ipairs(plan.tensors) do
      residents[index] = { tensor.name, tensor.dtype, tensor.shape, tensor.bytes }
    end
    for canonical, slices in pairs(plan.copies) do
      local names = {}
      for _, slice in ipairs(slices) do
        names[#names + 1] = slice.resident
        if slice.group then
          names[#names + 1] = plan.groups[slice.group].scale -- (a quantized slice writes its scale too)
        end
      end
      writes[canonical] = names
    end
    return require("cjson").encode({ residents = residents, writes = writes })
  end,
  --- {cmd, payload} -> the result of this process's engine worker, wsync's
  --- loader over an engine's parameters (wsync.runtime.engine_worker.call),
  --- its failure as the call's.
  worker_command = function(args)
    return require("cjson").encode(require("wsync.runtime.engine_worker").call(args.cmd, args.payload or {}))
  end,
  --- {backend, index} -> the device's identity (wsync.native.device.query).
  device = function(args)
    return require("cjson").encode(require("wsync.native.device").query(args.backend, args.index))
  end,
}

--- Runs the call `name` with the JSON object `args_text` (ws_host_call) and
--- answers JSON: `{"ok": true, "result": ...}`, or `{"ok": false, "error":
--- {code, message, fields}}` for a failure of wsync's own: `message` as `wsync
--- run` prints it, `fields` every field the error has (its bare `message`,
--- phase, rank, field, fatal, cause...). A Lua error (a bug) is raised, not
--- answered.
---@param name string
---@param args_text string
---@return string
function M.call(name, args_text)
  local cjson = require("cjson")
  local call = M.CALLS[name]
  if not call then
    return cjson.encode({ ok = false, error = { code = "INVALID_ARGUMENT", message = string.format(
      "ws_host_call: no call '%s' (there are: %s)", tostring(name),
      table.concat(require("wsync.util").sorted_keys(M.CALLS), ", ")), fields = {} } })
  end
  local decoded, args = pcall(cjson.decode, args_text)
  if not decoded or type(args) ~= "table" then
    return cjson.encode({ ok = false, error = { code = "INVALID_ARGUMENT", message = string.format(
      "ws_host_call %s: the arguments are not a JSON object", name), fields = {} } })
  end
  local ok, result = pcall(call, args)
  if ok then
    return '{"ok": true, "result": ' .. result .. "}"
  end
  if not errors.is(result) or result.code == "LUA_ERROR" then
    error(result, 0)
  end
  local fields = errors.fields(result)
  fields.code, fields.traceback = nil, nil
  return cjson.encode({ ok = false, error = { code = result.code, message = tostring(result), fields = fields } })
end

return M
