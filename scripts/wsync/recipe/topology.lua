--- The topology a model recipe describes, checked across its sections: the
--- trainer ranks, the TP workers and the rollout replicas they make, each
--- trainer rank sharing its device with the TP worker it feeds, the devices
--- the backend has, and the packed buffers' paths (direct, ordered on the
--- device) that only some topologies have. Each section's own fields are
--- wsync.recipe.fields'; this is the recipe's check that ties them together,
--- before anything starts (the publication's preflight would refuse the same
--- after the runtime had started).
local M = {}

--- Trainer ranks (and as many TP workers) on the cuda backend: they share
--- one node's GPUs. A static bound: check does not query the GPU; the
--- publication's preflight matches every rank to its device. On the host
--- backend the bound is its device count.
M.MAX_RANKS = 1024

---@class wsync.Topology
---@field world integer     trainer ranks
---@field tp integer        TP workers of one replica
---@field replicas integer  rollout replicas of `tp` workers each

--- The topology of a validated model recipe, as the plan, the schedule and
--- the session take it.
---@param recipe table  validated, with a model
---@return wsync.Topology
function M.of(recipe)
  return { world = recipe.trainer.ranks, tp = recipe.runtime.tp, replicas = recipe.runtime.replicas or 1 }
end

--- Checks how a model recipe's sections fit together (its sections checked
--- already, defaults filled): the trainer ranks and TP size given, no more
--- ranks than the backend's devices, trainer.ranks = runtime.replicas x
--- runtime.tp, the direct path with one rank on cuda, chunks ordered on the
--- device with cuda's packed buffers. A record check of wsync.recipe.schema:
--- true, or false, the message and the field.
---@param recipe table
---@return boolean ok, string? message, string? field
function M.check(recipe)
  if recipe.trainer.ranks == nil then
    return false, "is required", "trainer.ranks"
  end
  if recipe.runtime.tp == nil then
    return false, "is required", "runtime.tp"
  end
  local ranks = recipe.trainer.ranks
  local host_devices = recipe.backend == "host" and require("wsync.native.device").count("host")
  if host_devices and ranks > host_devices then
    return false, string.format("%d trainer ranks: the host backend has %d devices, one per trainer rank and its "
      .. "TP worker", ranks, host_devices), "trainer.ranks"
  elseif ranks > M.MAX_RANKS then
    return false, string.format("%d trainer ranks: at most %d on one node (its devices hold every rank and its TP "
      .. "worker)", ranks, M.MAX_RANKS), "trainer.ranks"
  end
  -- The publication's preflight refuses any other topology (trainer
  -- rank r and TP worker r share rank r's device).
  local replicas = recipe.runtime.replicas or 1
  if replicas == 1 and recipe.runtime.tp ~= recipe.trainer.ranks then
    return false, string.format("TP %d differs from the %d trainer ranks: TP worker r runs on trainer rank r's "
      .. "device, so runtime.tp must equal trainer.ranks", recipe.runtime.tp, recipe.trainer.ranks), "runtime.tp"
  elseif recipe.runtime.tp * replicas ~= recipe.trainer.ranks then
    return false, string.format("%d replicas x TP %d make %d TP workers for %d trainer ranks: each trainer rank "
      .. "feeds the TP worker on its device, so trainer.ranks must equal runtime.replicas x runtime.tp", replicas,
      recipe.runtime.tp, replicas * recipe.runtime.tp, recipe.trainer.ranks), "runtime.replicas"
  end
  if recipe.buffers.direct and (ranks ~= 1 or recipe.backend ~= "cuda") then
    return false, string.format("the direct path needs one trainer rank on the cuda backend (here %d on %s): "
      .. "several ranks gather their shards into packed buffers", ranks, recipe.backend), "buffers.direct"
  end
  if recipe.buffers.order == "device" and (recipe.backend ~= "cuda" or recipe.buffers.direct) then
    return false, string.format("chunks ordered on the device need the cuda backend's packed buffers (here %s%s)",
      recipe.backend, recipe.buffers.direct and ", the direct path" or ""), "buffers.order"
  end
  return true
end

return M
