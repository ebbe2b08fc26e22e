--- What `wsync check` shows and `wsync run` needs of a model recipe: its
--- plan, its topology, and its schedule checked against the plan and the
--- trainers' callbacks (wsync.plan.schedule), refusing first what this build
--- or this machine cannot serve.
local plan_module = require("wsync.plan")
local schedule_module = require("wsync.plan.schedule")

local M = {}

--- Checks the recipe's bootstrap and schedule against the plan and the
--- trainer callbacks (nil: not known yet); returns the memory report and the
--- normalized bootstrap and schedule steps.
---@param recipe table
---@param plan wsync.Plan
---@param topology {world: integer, tp: integer, replicas: integer}
---@param callbacks table<string, boolean>?
function M.check_schedule(recipe, plan, topology, callbacks)
  return schedule_module.check({
    plan = plan, topology = topology, memory = recipe.memory, bootstrap = recipe.bootstrap,
    schedule = recipe.schedule, budget = recipe.memory.device_bytes, callbacks = callbacks,
  })
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
--- build or this machine cannot serve (RECIPE_INVALID: wsync.recipe's
--- check_serve and check_machine), so that nothing starts for it.
---@param recipe table
---@param options {plan_only: boolean?}?
function M.prepare(recipe, options)
  local serve = not (options and options.plan_only)
  local recipe_module = require("wsync.recipe")
  if serve then
    recipe_module.check_serve(recipe)
  end
  local model = recipe.model
  local plan = plan_module.build({ family = model.family, config = model.preset or model.config }, recipe.buffers)
  -- (`gated`: the ranks make gates, so that the chunks may be ordered on the
  -- device: required with "device", taken with "auto" when the runtime's
  -- workers can wait on them. Only cuda's packed buffers have gates.)
  plan.gated = plan.ordered or (recipe.buffers.order == "auto" and recipe.backend == "cuda" and not plan.direct)
    or nil
  local topology = { world = recipe.trainer.ranks, tp = recipe.runtime.tp, replicas = recipe.runtime.replicas or 1 }
  plan_module.family(plan.family).check_tp(plan.config, topology.tp)
  local memory_report, bootstrap, steps = M.check_schedule(recipe, plan, topology, M.known_callbacks(recipe))
  if serve then
    recipe_module.check_machine(recipe, plan, topology, memory_report)
  end
  return plan, topology, memory_report, bootstrap, steps
end

return M
