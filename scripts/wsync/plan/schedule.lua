--- The memory schedule: the order in which trainer and rollout memory moves
--- around a publication, checked before it runs and modelled per device.
---
--- A step is a trainer callback name ("offload_optimizer"), a rollout step
--- (`{sleep = 1|2}`, `{wake = {"weights", "kv_cache"}}`, `{pause = "abort" |
--- "wait" | "keep", kv = "recompute" | "keep"}`, "resume"), "publish" or
--- "generate", or `{together = {TRAINER_STEP, ROLLOUT_STEP}}`: a trainer
--- callback and a rollout step (sleep, wake, pause, resume) at once, where the
--- model shows that the device holds what either order of the two leaves
--- between them. Publishing while generation can run (the KV cache awake and no
--- pause) is refused. The usual per-publication schedule: offload_optimizer, wake
--- weights, publish, offload_actor, wake kv_cache, generate, sleep 2,
--- onload_actor, onload_optimizer. `bootstrap` runs once first: sleep level 1
--- keeps the rollout's initial weights in host memory; later sleeps use level
--- 2 and discard them, since publish rewrites them.
---
--- The model of one device, two processes on it: a trainer rank (its CUDA
--- context, its FSDP share of parameters, gradients and optimizer state, the
--- packed buffers from the first publish on, plus the largest tensor in
--- flight during a publish) and a TP worker of the rollout. The reference
--- runtime's worker holds its context, its resident TP-local weights and its
--- KV arena (memory.kv_bytes). vLLM's holds its context and what it reserved:
--- gpu_memory_utilization of the device for weights, KV cache, activations
--- and its non-torch memory, all of it while awake (it sizes the KV cache so
--- that the process, its context included, fills the reservation), and only
--- its context and what sleep leaves (M.VLLM_ASLEEP_BYTES) plus its weights
--- when they alone are awake. The device's total comes from
--- memory.device_bytes or, at run time, from the device itself; without it
--- vLLM's reservation is not modelled (`sizes.unmodelled` says so).
local errors = require("wsync.errors")
local plan_module = require("wsync.plan")

local M = {}

local MIB = 1024 * 1024

--- A CUDA process's memory before it holds anything of the run: its context
--- (0.49-0.55 GiB per process measured on the H200, CUDA 13, torch 2.11:
--- tests/bench/logs/h200-2026-12-03). memory.context_bytes overrides it.
M.CONTEXT_BYTES = 512 * MIB

--- What a sleeping vLLM worker keeps beyond its context: its non-torch memory
--- and what torch's allocator keeps (0.33 GiB for a 6 MiB model, 0.58 GiB for
--- a 1.5 GB one, vLLM 0.26 on the H200).
M.VLLM_ASLEEP_BYTES = 460 * MIB

--- vLLM's own default share of the device.
M.VLLM_UTILIZATION = 0.9

--- Trainer callbacks with a known effect on memory. Other registered callbacks
--- may be scheduled; they move nothing in the model.
M.TRAINER_EFFECTS = {
  offload_optimizer = { part = "optimizer", from = true, to = false },
  onload_optimizer = { part = "optimizer", from = false, to = true },
  offload_actor = { part = "actor", from = true, to = false },
  onload_actor = { part = "actor", from = false, to = true },
}

local function invalid(message, fields)
  errors.raise("SCHEDULE_INVALID", message, fields)
end

-- "keys sleep and wake", for a message about a step table.
local function describe_keys(step)
  local keys = {}
  for key in pairs(step) do
    keys[#keys + 1] = tostring(key)
  end
  table.sort(keys)
  if #keys == 0 then
    return "no keys"
  end
  return (#keys == 1 and "key " or "keys ") .. table.concat(keys, ", ")
end

--- Normalizes one step; raises SCHEDULE_INVALID naming the step.
---@param step any
---@param where string  "schedule[3]"
---@return table  {kind = "trainer"|"sleep"|"wake"|"publish"|"generate"|"pause"|"resume", ...}
function M.normalize(step, where)
  if step == "publish" or step == "generate" or step == "resume" then
    return { kind = step, where = where }
  elseif type(step) == "table" and step.together ~= nil then
    return M.normalize_together(step, where)
  elseif type(step) == "table" and step.pause ~= nil then
    for key in pairs(step) do
      if key ~= "pause" and key ~= "kv" then
        invalid(string.format("%s: a pause step is {pause = \"abort\"|\"wait\"|\"keep\", kv = \"recompute\"|\"keep\"}; "
          .. "this table has %s", where, describe_keys(step)), { field = where })
      end
    end
    if step.pause ~= "abort" and step.pause ~= "wait" and step.pause ~= "keep" then
      invalid(string.format("%s: pause mode must be abort, wait or keep, got %s", where, tostring(step.pause)),
        { field = where })
    end
    if step.kv ~= nil and (step.pause ~= "keep" or (step.kv ~= "recompute" and step.kv ~= "keep")) then
      invalid(string.format("%s: kv (recompute or keep) is the KV policy of a keep-mode pause; got kv = %s with "
        .. "pause = %s", where, tostring(step.kv), tostring(step.pause)), { field = where })
    end
    return { kind = "pause", mode = step.pause, kv = step.kv, where = where }
  elseif type(step) == "string" then
    return { kind = "trainer", name = step, where = where }
  elseif type(step) == "table" and (step.sleep ~= nil) == (step.wake ~= nil) or type(step) == "table" and
      next(step, next(step)) ~= nil then
    invalid(string.format("%s: a step is a trainer callback name, \"publish\", \"generate\", {sleep = N} or "
      .. "{wake = {...}}; this table has %s", where, describe_keys(step)), { field = where })
  elseif type(step) == "table" and step.sleep ~= nil then
    if step.sleep ~= 1 and step.sleep ~= 2 then
      invalid(string.format("%s: sleep level must be 1 or 2, got %s", where, tostring(step.sleep)), { field = where })
    end
    return { kind = "sleep", level = step.sleep, where = where }
  elseif type(step) == "table" and step.wake ~= nil then
    local tags = type(step.wake) == "table" and step.wake or { step.wake }
    local seen = {}
    for _, tag in ipairs(tags) do
      if tag ~= "weights" and tag ~= "kv_cache" then
        invalid(string.format("%s: unknown wake tag %s (weights, kv_cache)", where, tostring(tag)), { field = where })
      end
      seen[tag] = true
    end
    if not next(seen) then
      invalid(where .. ": wake needs at least one tag", { field = where })
    end
    return { kind = "wake", tags = tags, weights = seen.weights, kv_cache = seen.kv_cache, where = where }
  end
  invalid(string.format("%s: a step is a trainer callback name, \"publish\", \"generate\", {sleep = N} or "
    .. "{wake = {...}}", where), { field = where })
end

-- The kinds of step that the rollout runtime runs (a together step's second).
local ROLLOUT_KINDS = { sleep = true, wake = true, pause = true, resume = true }

--- Normalizes `{together = {TRAINER_STEP, ROLLOUT_STEP}}` (in either order):
--- {kind = "together", parts = {trainer step, rollout step}}; raises
--- SCHEDULE_INVALID naming the step.
---@param step table
---@param where string
function M.normalize_together(step, where)
  local parts = step.together
  if next(step, next(step)) ~= nil or type(parts) ~= "table" or #parts ~= 2 then
    invalid(string.format("%s: a together step is {together = {TRAINER_STEP, ROLLOUT_STEP}}: a trainer callback "
      .. "and a sleep, wake, pause or resume, run at once", where), { field = where })
  end
  local trainer, rollout
  for i, part in ipairs(parts) do
    local normalized = M.normalize(part, string.format("%s.together[%d]", where, i))
    if normalized.kind == "trainer" and not trainer then
      trainer = normalized
    elseif ROLLOUT_KINDS[normalized.kind] and not rollout then
      rollout = normalized
    else
      invalid(string.format("%s: together runs one trainer callback beside one rollout step (sleep, wake, pause, "
        .. "resume); together[%d] is %s", where, i, normalized.kind == "trainer" and "a second trainer callback"
        or normalized.kind == "together" and "a together step" or ("a " .. normalized.kind .. " step")),
        { field = where })
    end
  end
  return { kind = "together", parts = { trainer, rollout }, where = where }
end

local describe
function describe(step)
  if step.kind == "together" then
    return describe(step.parts[1]) .. " + " .. describe(step.parts[2])
  elseif step.kind == "trainer" then
    return step.name
  elseif step.kind == "sleep" then
    return "sleep " .. step.level
  elseif step.kind == "wake" then
    return "wake " .. table.concat(step.tags, "+")
  elseif step.kind == "pause" then
    return "pause " .. step.mode .. (step.kv and (" (kv " .. step.kv .. ")") or "")
  end
  return step.kind
end
M.describe = describe

--- The engine of a recipe as the model sees it: {kind, utilization} for
--- vLLM on a GPU (gpu_memory_utilization, vLLM's default where the recipe
--- leaves it), {kind} otherwise (vLLM on the host backend is a stand-in
--- engine, modelled as the reference runtime); `cuda`: whether its processes
--- hold CUDA contexts.
---@param recipe table
function M.engine_of(recipe)
  local runtime = recipe.runtime or {}
  local engine = { kind = runtime.kind or "reference", cuda = recipe.backend == "cuda" }
  if engine.kind == "vllm" and engine.cuda then
    engine.utilization = (runtime.vllm or {}).gpu_memory_utilization or M.VLLM_UTILIZATION
  end
  if engine.kind == "vllm" then
    engine.quantization = (runtime.vllm or {}).quantization -- (what vLLM holds: the family's rollout_residents)
  else
    engine.quantization = runtime.quantization -- (the reference runtime holding what vLLM would)
  end
  return engine
end

--- The per-device sizes the model adds up, from the plan, the recipe's
--- memory table and its engine (M.engine_of; nil: the reference runtime on
--- the host backend). `device_bytes`: the device's total, for vLLM's
--- reservation (default memory.device_bytes).
---@param plan wsync.Plan
---@param topology {world: integer, tp: integer}
---@param memory table  recipe.memory
---@param engine table?
---@param device_bytes number?
function M.sizes(plan, topology, memory, engine, device_bytes)
  local family = plan_module.family(plan.family)
  engine = engine or { kind = "reference" }
  local rollout = 0
  for rank = 0, topology.tp - 1 do
    rollout = math.max(rollout, family.rollout_residents(plan.config, topology.tp, rank, engine.quantization).bytes)
  end
  local params = math.ceil(plan.bytes / topology.world)
  local sizes = {
    params = params,
    gradients = memory.gradients == false and 0 or params,
    optimizer = params * (memory.optimizer_factor or 6),
    rollout = rollout,
    kv_cache = memory.kv_bytes or 0,
    buffers = plan.buffer_bytes * plan.buffer_count,
    largest = plan.largest.bytes,
    context = engine.cuda and (memory.context_bytes or M.CONTEXT_BYTES) or 0,
  }
  if engine.kind == "vllm" and engine.utilization then
    device_bytes = device_bytes or memory.device_bytes
    if device_bytes then
      sizes.reservation = math.floor(engine.utilization * device_bytes)
      sizes.asleep = M.VLLM_ASLEEP_BYTES
      if sizes.reservation <= rollout + sizes.asleep then
        errors.raise("SCHEDULE_INVALID", string.format("vLLM's reservation, gpu_memory_utilization %g of the "
          .. "device's %s, is %s: it does not hold a TP worker's %s of weights and the %s it needs beside them, "
          .. "so no KV cache fits; raise gpu_memory_utilization", engine.utilization,
          plan_module.format_bytes(device_bytes), plan_module.format_bytes(sizes.reservation),
          plan_module.format_bytes(rollout), plan_module.format_bytes(sizes.asleep)),
          { field = "runtime.vllm.gpu_memory_utilization" })
      end
      sizes.kv_cache = math.max(0, sizes.reservation - rollout - sizes.asleep)
      sizes.device_bytes = device_bytes
    else
      sizes.unmodelled = string.format("vLLM's reservation (gpu_memory_utilization %g of the device): the "
        .. "device's total is not known here (memory.device_bytes)", engine.utilization)
    end
  end
  return sizes
end

-- The trainer rank's bytes and the TP worker's in `state`.
local function parts(state, sizes)
  local trainer = sizes.context
  if state.actor then
    trainer = trainer + sizes.params + sizes.gradients
  end
  if state.optimizer then
    trainer = trainer + sizes.optimizer
  end
  if state.buffers then
    trainer = trainer + sizes.buffers
  end
  local rollout = sizes.context
  if sizes.reservation then
    if state.weights == "awake" and state.kv_memory then
      -- (vLLM sizes its KV cache so that the whole process, its context
      -- included, holds the reservation: 118.87 GiB measured against 118.83
      -- reserved, tests/bench/logs/h200-2026-12-03-s2.)
      rollout = math.max(sizes.context, sizes.reservation)
    else
      rollout = rollout + sizes.asleep + (state.weights == "awake" and sizes.rollout or 0)
    end
  else
    rollout = rollout + (state.weights == "awake" and sizes.rollout or 0) + (state.kv_memory and sizes.kv_cache or 0)
  end
  return trainer, rollout
end

local function usage(state, sizes)
  local trainer, rollout = parts(state, sizes)
  return trainer + rollout
end

-- Applies one step to the modelled state; returns the peak during the step.
local apply
function apply(state, step, sizes, callbacks)
  if step.kind == "together" then
    -- (Either part may end first: the peak is the most that either order
    -- holds between the two. Both orders end in the same state.)
    local trainer, rollout = step.parts[1], step.parts[2]
    local trial = require("wsync.util").merged(state)
    local peak = apply(trial, rollout, sizes, callbacks)
    peak = math.max(peak, apply(trial, trainer, sizes, callbacks))
    peak = math.max(peak, apply(state, trainer, sizes, callbacks))
    return math.max(peak, apply(state, rollout, sizes, callbacks))
  end
  local function refuse(message)
    invalid(string.format("%s (%s): %s", step.where, describe(step), message), { field = step.where })
  end
  if step.kind == "trainer" then
    local effect = M.TRAINER_EFFECTS[step.name]
    if callbacks and not callbacks[step.name] then
      local known = require("wsync.util").sorted_keys(callbacks)
      refuse(string.format("not a callback that every trainer rank has (they have: %s)",
        #known > 0 and table.concat(known, ", ") or "none"))
    end
    if effect then
      if state[effect.part] ~= effect.from then
        refuse(string.format("the %s is already %s", effect.part, effect.from and "offloaded" or "resident"))
      end
      state[effect.part] = effect.to
      state[effect.part .. "_moved_by"] = step.where .. " (" .. describe(step) .. ")"
    end
  elseif step.kind == "sleep" then
    state.kv_cache, state.kv_memory = false, false
    if state.weights == "awake" then
      state.weights = step.level == 1 and "offloaded" or "discarded"
    elseif state.weights == "offloaded" and step.level == 2 then
      state.weights = "discarded"
    end
  elseif step.kind == "wake" then
    if step.weights then
      state.weights = "awake"
    end
    if step.kv_cache then
      if state.weights ~= "awake" then
        refuse("wake kv_cache needs the rollout weights awake: wake weights first")
      end
      state.kv_cache, state.kv_memory = true, true
    end
  elseif step.kind == "publish" then
    if not state.actor then
      refuse("publish needs the actor resident: onload_actor before publish")
    end
    if state.weights ~= "awake" then
      refuse("publish needs the rollout weights awake: wake weights before publish")
    end
    if state.kv_cache and not state.paused then
      refuse("publish while generation can run (the kv_cache is awake and generation is not paused): pause it "
        .. "first ({pause = \"keep\"} before publish, \"resume\" after), or sleep the rollout")
    end
    local peak = usage(state, sizes) + (state.buffers and 0 or sizes.buffers) + sizes.largest
    state.buffers = true
    return peak
  elseif step.kind == "generate" then
    if state.weights ~= "awake" or not state.kv_cache then
      refuse("generate needs the weights and the kv_cache awake")
    end
    if state.paused then
      refuse("generate while generation is paused: resume first")
    end
  elseif step.kind == "pause" then
    if state.paused then
      refuse("generation is paused already (a pause needs a resume before the next)")
    end
    state.paused = true
  elseif step.kind == "resume" then
    if not state.paused then
      refuse("resume without a pause before it")
    end
    state.paused = false
  end
  return usage(state, sizes)
end

---@class wsync.ScheduleCheckOptions
---@field plan wsync.Plan
---@field topology table
---@field memory table
---@field bootstrap any[]
---@field schedule any[]
---@field budget number
---@field callbacks table<string, boolean>?
---@field engine table?  M.engine_of(recipe)
---@field device_bytes number?  the device's total, when known (default memory.device_bytes)

--- Checks a bootstrap and a per-publication schedule against the model of one
--- device and returns the report: `{steps = {{where, step, bytes,
--- trainer_bytes, rollout_bytes}}, steady_steps, peak, peak_step, budget,
--- sizes}` (bytes: after the step, or during it where that is more: a
--- publish; `steps`: the bootstrap and the first round, `steady_steps`: the
--- schedule's steps in every later round). Raises SCHEDULE_INVALID naming
--- the step that makes no sense or would overflow `budget`, or a schedule
--- that does not give the trainer back resident (it trains between
--- publications).
---@param options wsync.ScheduleCheckOptions
function M.check(options)
  local sizes = M.sizes(options.plan, options.topology, options.memory or {}, options.engine, options.device_bytes)
  local bootstrap, steps = {}, {}
  for i, step in ipairs(options.bootstrap or {}) do
    bootstrap[i] = M.normalize(step, string.format("bootstrap[%d]", i))
    local kind = bootstrap[i].kind == "together" and bootstrap[i].parts[2].kind or bootstrap[i].kind
    if kind == "publish" or kind == "generate" or kind == "pause" or kind == "resume" then
      invalid(string.format("bootstrap[%d]: %s belongs in the schedule; the bootstrap only moves memory (trainer "
        .. "callbacks, sleep, wake)", i, kind), { field = bootstrap[i].where })
    end
  end
  for i, step in ipairs(options.schedule or {}) do
    steps[i] = M.normalize(step, string.format("schedule[%d]", i))
  end
  local publishes = 0
  for _, step in ipairs(steps) do
    if step.kind == "publish" then
      publishes = publishes + 1
      if publishes == 2 then
        invalid(string.format("%s: a second publish; the schedule must publish exactly once", step.where),
          { field = step.where })
      end
    end
  end
  if publishes == 0 then
    invalid("the schedule never publishes; it must publish exactly once", { field = "schedule" })
  end
  -- (vLLM starts with its KV cache reserved; `kv_cache` is whether generation
  -- may run, for the checks above: only a wake makes it so.)
  -- (memory.optimizer_at_start = false: the optimizer's state is made by
  -- the trainer's first step, after the runtime started and the bootstrap
  -- ran, as torch's optimizers make theirs.)
  local memory = options.memory or {}
  local state = { actor = true, optimizer = memory.optimizer_at_start ~= false, weights = "awake", kv_cache = false,
    buffers = false, kv_memory = (options.engine or {}).kind == "vllm" }
  local report = { steps = {}, peak = usage(state, sizes), peak_step = "start", budget = options.budget,
    sizes = sizes }
  -- Exact byte counts: two sizes close together read the same in MiB.
  local function check_budget(where, bytes, field)
    if options.budget and bytes > options.budget then
      invalid(string.format("%s needs %d bytes (%s) on each device; the budget is %d bytes (%s): %d bytes (%s) "
        .. "over", where, bytes, plan_module.format_bytes(bytes), options.budget,
        plan_module.format_bytes(options.budget), bytes - options.budget,
        plan_module.format_bytes(bytes - options.budget)),
        { field = field or (where:match("^%S+") == "start" and "memory.device_bytes" or where:match("^%S+")) })
    end
  end
  -- Before any step: the trainer with its optimizer (unless the first step
  -- makes it) and the rollout's weights, both resident, as the runtime
  -- starts.
  check_budget(state.optimizer and "start (trainer and rollout weights resident)"
    or "start (the trainer's actor and the rollout weights resident)", report.peak)
  report.steady_steps = {}
  local function run(list, pass)
    for _, step in ipairs(list) do
      local bytes = apply(state, step, sizes, options.callbacks)
      local trainer, rollout = parts(state, sizes)
      local into = pass == 1 and report.steps or report.steady_steps
      -- (after_bytes: a together step's peak is while its two parts run;
      -- after them the device holds what they leave.)
      into[#into + 1] = { where = step.where, step = describe(step), bytes = bytes, trainer_bytes = trainer,
        rollout_bytes = rollout, after_bytes = step.kind == "together" and trainer + rollout or nil }
      if bytes > report.peak then
        report.peak, report.peak_step = bytes, step.where .. " (" .. describe(step) .. ")"
      end
      check_budget(step.where .. " (" .. describe(step) .. ")", bytes)
    end
  end
  run(bootstrap, 1)
  if memory.optimizer_at_start == false then
    if not state.optimizer then
      state.optimizer = true
      local trainer, rollout = parts(state, sizes)
      report.first_step = { bytes = trainer + rollout, trainer_bytes = trainer, rollout_bytes = rollout }
      local where = "the first train_step (it makes the optimizer's state)"
      if report.first_step.bytes > report.peak then
        report.peak, report.peak_step = report.first_step.bytes, where
      end
      check_budget(where, report.first_step.bytes, "memory.optimizer_at_start")
    end
  end
  local start = require("wsync.util").merged(state)
  run(steps, 1)
  if not (state.actor and state.optimizer) then
    local part = state.actor and "optimizer" or "actor"
    local moved_by = state[part .. "_moved_by"]
    invalid(string.format("%s offloads the trainer's %s and no later step onloads it; the schedule must end with "
      .. "it resident for the next training step", moved_by, part), { field = moved_by:match("^%S+") })
  end
  -- Steady state: a second pass from where the first ended must be valid too.
  run(steps, 2)
  report.steady = state.weights == start.weights or nil
  return report, bootstrap, steps
end

--- The bytes `report` (M.check's) predicts on a device after the step at
--- `where` ("bootstrap[1]", "schedule[3]"; a together step's after both its
--- parts, not its peak): the first round's, or with `steady` the later
--- rounds'; nil for a step it does not know.
---@param report table
---@param where string
---@param steady boolean?
---@return number?
function M.predicted_bytes(report, where, steady)
  local list = steady and where:match("^schedule") and report.steady_steps or report.steps
  for _, entry in ipairs(list) do
    if entry.where == where then
      return entry.after_bytes or entry.bytes
    end
  end
  return nil
end

return M
