--- What `wsync check` shows and `wsync run` needs of a model recipe: its
--- plan, its topology, and its schedule checked against the plan and the
--- trainers' callbacks (wsync.plan.schedule), refusing first what this build
--- or this machine cannot serve (wsync.recipe.serve). Also the check that
--- `wsync check` and `wsync run` make of any recipe before anything starts,
--- whose refusals are RECIPE_INVALID naming the recipe's file, line and
--- field (wsync.recipe.location).
local errors = require("wsync.errors")
local location = require("wsync.recipe.location")
local plan_module = require("wsync.plan")
local schedule_module = require("wsync.plan.schedule")
local serve = require("wsync.recipe.serve")
local topology_module = require("wsync.recipe.topology")

local M = {}

--- Checks the recipe's bootstrap and schedule against the plan and the
--- trainer callbacks (nil: not known yet); returns the memory report and the
--- normalized bootstrap and schedule steps. `device_bytes`: the device's total where known (at run time, from the
--- device), for vLLM's reservation; default memory.device_bytes.
---@param recipe table
---@param plan wsync.Plan
---@param topology {world: integer, tp: integer, replicas: integer}
---@param callbacks table<string, boolean>?
---@param device_bytes number?
function M.check_schedule(recipe, plan, topology, callbacks, device_bytes)
  return schedule_module.check({
    plan = plan, topology = topology, memory = recipe.memory, bootstrap = recipe.bootstrap,
    schedule = recipe.schedule, budget = recipe.memory.device_bytes, callbacks = callbacks,
    engine = schedule_module.engine_of(recipe), device_bytes = device_bytes,
  })
end

--- Refuses a vllm recipe's `runtime.vllm.quantization` that wsync cannot
--- plan: it plans bfloat16 and "fp8" (vLLM's own loader quantizes with load
--- = "native"; wsync's direct loader quantizes while it copies, under the
--- loader plan's groups, and its check reloads the same bfloat16 through
--- vLLM's own FP8 loader). Refuses too the values check of a quantized
--- rollout: its sums are of the trainer's bfloat16 values, which FP8
--- residents do not hold.
---@param recipe table
function M.check_quantization(recipe)
  local runtime = recipe.runtime
  local quantization = schedule_module.engine_of(recipe).quantization
  if quantization ~= nil and quantization ~= "fp8" then
    errors.raise("INVALID_ARGUMENT", string.format("quantization %s: wsync plans bfloat16 rollouts and \"fp8\" "
      .. "(vLLM's online per-tensor FP8 of a bfloat16 checkpoint)", tostring(quantization)),
      { field = runtime.kind == "vllm" and "runtime.vllm.quantization" or "runtime.quantization" })
  end
  if quantization ~= nil and recipe.verify == "values" then
    errors.raise("INVALID_ARGUMENT", string.format("verify = \"values\" sums the trainer's bfloat16 values, and "
      .. "under quantization %s the residents hold their FP8 quantization: verify = true checks it (synthetic "
      .. "trainers)", quantization), { field = "verify" })
  end
end

--- The trainer callbacks a recipe's ranks are known to have before they
--- register: the synthetic trainer's four; nil (not known yet) for external
--- ranks, whose registrations are checked when they arrive.
---@param recipe table
---@return table<string, boolean>?
function M.known_callbacks(recipe)
  if recipe.trainer.kind ~= "synthetic" then
    return nil
  end
  local names = {}
  for name in pairs(schedule_module.TRAINER_EFFECTS) do
    names[name] = true
  end
  return names
end

--- The plan and the schedule report (then the normalized bootstrap and
--- schedule steps) of a validated recipe with a model. Raises with the
--- recipe's field named. Unless `options.plan_only`, refuses first what this
--- build or this machine cannot serve (RECIPE_INVALID: wsync.recipe.serve's
--- check_serve and check_machine), so that nothing starts for it.
---@param recipe table
---@param options {plan_only: boolean?}?
function M.prepare(recipe, options)
  local plan_only = options and options.plan_only
  if not plan_only then
    serve.check_serve(recipe)
  end
  local model = recipe.model
  local plan = plan_module.build({ family = model.family, config = model.preset or model.config,
    quantization = schedule_module.engine_of(recipe).quantization }, recipe.buffers)
  -- (`gated`: the ranks make gates, so that the chunks may be ordered on the
  -- device: required with "device", taken with "auto" when the runtime's
  -- workers can wait on them. Only cuda's packed buffers have gates.)
  plan.gated = plan.ordered or (recipe.buffers.order == "auto" and recipe.backend == "cuda" and not plan.direct)
    or nil
  local topology = topology_module.of(recipe)
  plan_module.family(plan.family).check_tp(plan.config, topology.tp)
  M.check_quantization(recipe)
  local memory_report, bootstrap, steps = M.check_schedule(recipe, plan, topology, M.known_callbacks(recipe))
  if not plan_only then
    serve.check_machine(recipe, plan, topology, memory_report)
  end
  return plan, topology, memory_report, bootstrap, steps
end

--- Builds the plan and checks the memory schedule of a recipe with a model,
--- and (unless `options.plan_only`) that this build and this machine can
--- serve it (M.prepare). Failures become RECIPE_INVALID naming the file,
--- the line and the field.
---@param recipe table  validated, with `path`
---@param options {plan_only: boolean?}?
---@return wsync.Plan plan, table topology, table memory_report
function M.check_plan(recipe, options)
  local ok, plan, topology, memory = pcall(M.prepare, recipe, options)
  if ok then
    return plan, topology, memory
  end
  local err = plan
  if errors.is(err) and err.code ~= "RECIPE_INVALID" then
    local field = err.field
    if err.code == "MODEL_UNSUPPORTED" then
      -- (The model's own field: one of the recipe's model.config, or the
      -- preset's.)
      field = recipe.model.config and field and ("model.config." .. field) or "model"
    end
    location.refuse(recipe, field or (err.code == "SCHEDULE_INVALID" and "schedule") or "model", err.message)
  end
  error(err, 0)
end

--- Refuses what `wsync run` would refuse before it starts anything, for
--- `wsync check` and `wsync run` alike: a recipe with nothing to run, and for
--- a model recipe what M.check_plan refuses. Raises RECIPE_INVALID naming
--- file:line and the field; returns a model recipe's plan, topology and
--- memory report.
---@param recipe table  validated, with `path`
---@param options {plan_only: boolean?}?
---@return wsync.Plan? plan, table? topology, table? memory_report
function M.check(recipe, options)
  if recipe.model then
    return M.check_plan(recipe, options)
  end
  if not recipe.run then
    location.invalid(recipe.path, "the recipe has nothing to run: it defines neither `run` nor `model`",
      { line = location.field_line(recipe.path, "") })
  end
  return nil
end

return M
