--- The resident check after a committed publication, as a recipe's `verify`
--- asks (wsync.recipe.verify_mode): what every TP worker of every replica
--- holds, checked against the trainer, one of three ways.
---
--- - "values": the trainer's own values. Every rank sums its rows for every
---   TP worker's resident tensors (`values_sums`), every worker sums what it
---   holds (`resident_values`), and the sums must agree
---   (wsync.plan.values).
--- - synthetic values on the device: where the transport can check a slice
---   on the device (its capability `device_check`), each worker checks every resident
---   slice against the step's synthetic values (`resident_check`), with no
---   copy to the host (61 GB is not read back for a check). Not under a
---   quantization: a quantized slice is no copy of the values, and only the
---   checksums below see it.
--- - synthetic checksums: each worker's SHA-256 of every resident tensor
---   (`resident_checksums`) against the ones computed here from the
---   synthetic values (wsync.publish.verify).
---
--- Raises the check's error (VERIFY_RESIDENT, VERIFY_VALUES...) naming the
--- worker; returns what it counted.
local plan_module = require("wsync.plan")
local verify = require("wsync.publish.verify")

local M = {}

---@class wsync.ResidentCheck
---@field mode string           "values", or anything else: the synthetic values
---@field plan table            the session's plan
---@field tp integer
---@field ranks table           wsync.publish.ranks (its `all`)
---@field transport table       the transport (its `check_synthetic`, where it has one)
---@field timeouts table
---@field loaders table[]?      each TP rank's loader plan, made at the first values check
local Check = {}
Check.__index = Check

--- A check for a session: `context` is {mode, plan, tp, ranks, transport,
--- timeouts}.
---@param context table
---@return wsync.ResidentCheck
function M.new(context)
  return setmetatable({ mode = context.mode, plan = context.plan, tp = context.tp, ranks = context.ranks,
    transport = context.transport, timeouts = context.timeouts }, Check)
end

-- Runs `check(workers)` ({workers, tensors} checked) on every replica's
-- part of a resident-check answer; the counts of all.
local function per_replica(rollout, reported, check)
  local verified = { workers = 0, tensors = 0 }
  for _, workers in ipairs(rollout:by_replica(reported)) do
    local one = check(workers)
    verified.workers, verified.tensors = verified.workers + one.workers, verified.tensors + one.tensors
  end
  return verified
end

-- The values check: every rank's sums of its rows, for every TP worker's
-- resident tensors, against what the workers hold; every replica holds the
-- same, so each is checked against the same sums.
function Check:_values(rollout)
  local plan, tp = self.plan, self.tp
  local payload = { family = plan.family, config = plan.config, tp = tp }
  local ranks = self.ranks:all("values_sums", function()
    return payload
  end, self.timeouts.values_sums)
  local by_rank = {}
  for r, result in ipairs(ranks) do
    by_rank[r] = result.workers
  end
  if not self.loaders then
    local family = plan_module.family(plan.family)
    self.loaders = {}
    for w = 1, tp do
      self.loaders[w] = family.loader_plan(plan.config, tp, w - 1)
    end
  end
  return per_replica(rollout, rollout:request("resident_values", {}), function(workers)
    return require("wsync.plan.values").check(self.loaders, by_rank, workers)
  end)
end

--- Checks what `rollout` (wsync.publish.rollout: a runtime or a replica set)
--- holds after the publication of trainer step `step`. Returns what it
--- counted ({workers, tensors}, or {workers, slices, elements} on the device).
---@param rollout table
---@param step integer
---@return table
function Check:check(rollout, step)
  if self.mode == "values" then
    return self:_values(rollout)
  elseif require("wsync.transport").can(self.transport, "device_check") and not self.plan.quantization then
    local reported = rollout:request("resident_check", { step = step })
    return verify.check_on_device(step, reported.workers)
  end
  return per_replica(rollout, rollout:request("resident_checksums", {}), function(workers)
    return verify.check(self.plan, self.tp, step, workers)
  end)
end

return M
