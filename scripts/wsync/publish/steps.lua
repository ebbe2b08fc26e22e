--- The memory schedule's steps as a session runs them (wsync.plan.schedule
--- checks, models and names them): a trainer callback on every rank at once,
--- or a command to the rollout runtime (sleep, wake, generate, pause,
--- resume), each timed as a step of the run report's round or opening. It
--- keeps what the trainer ranks hold after their callbacks (the actor's and
--- the optimizer's memory, offloaded or back), so that a failed round can
--- give back what it had offloaded (Steps:onloads). The "publish" step is
--- the session's own (wsync.publish.publication).
local loop = require("wsync.loop")
local report_module = require("wsync.publish.report")
local schedule_module = require("wsync.plan.schedule")

local M = {}

---@class wsync.ScheduleSteps
---@field resident {actor: boolean, optimizer: boolean}  whether the trainer ranks hold each part now
local Steps = {}
Steps.__index = Steps

--- A runner for a session whose ranks hold everything; a trainer callback
--- gets `callback_timeout` seconds (timeouts.callback).
---@param callback_timeout number
---@return wsync.ScheduleSteps
function M.new(callback_timeout)
  return setmetatable({ callback_timeout = callback_timeout, resident = { actor = true, optimizer = true } }, Steps)
end

--- Where the device memory after each step comes from: `sample(where)`
--- returns what wsync.publish.memory_probe's sample does (nil: nothing to
--- say) and the model's prediction for the step at `where` (bytes on the
--- most loaded device, or nil); each step's report entry keeps them as its
--- `device_memory` and `predicted_bytes`.
---@param sample fun(where: string): table[]?, number?
function Steps:sample_memory_with(sample)
  self.sample = sample
end

--- The round's generation (wsync.publish.registry's generation_request):
--- the request the next "generate" step sends instead of an empty one, and
--- where its answer is kept (`answer`); nil: none asked.
---@param generation {request: table}?
function Steps:generate_for(generation)
  self.generation = generation
end

-- Runs one step that is not "together"; returns the bytes the trainer
-- ranks' callbacks said they moved (nil where none said).
function Steps:_part(step, ranks, rollout)
  local moved
  if step.kind == "trainer" then
    -- (bytes: what each rank's callback said it moved, added up; nil where
    -- none said.)
    for _, answer in ipairs(ranks:all("callback", function()
      return { name = step.name }
    end, self.callback_timeout)) do
      moved = answer.bytes and (moved or 0) + answer.bytes or moved
    end
    local effect = schedule_module.TRAINER_EFFECTS[step.name]
    if effect then
      self.resident[effect.part] = effect.to
    end
  elseif step.kind == "sleep" then
    rollout:request("sleep", { level = step.level })
  elseif step.kind == "wake" then
    rollout:request("wake", { tags = step.tags })
  elseif step.kind == "generate" then
    -- (What the ranks asked their publish to generate, when they asked:
    -- Steps:generate_for; its answer is kept for their answers.)
    local asked = self.generation
    local answer = rollout:request("generate", asked and asked.request or {})
    if asked then
      asked.answer = answer
    end
  elseif step.kind == "pause" then
    -- (With several replicas, a two-phase pause: wsync.publish.rollout.)
    rollout:pause({ mode = step.mode, kv = step.kv })
  elseif step.kind == "resume" then
    rollout:request("resume", {})
  end
  return moved
end

--- Runs schedule step `step` (not "publish") on `ranks` (wsync.Ranks: a
--- trainer callback) or `rollout` (wsync.Rollout or ReplicaSet: the rest),
--- timed into `target` (a round of wsync.publish.report, or its opening) as
--- the step wsync.plan.schedule's describe names; raises what failed.
---@param step table  a step of wsync.plan.schedule (normalized)
---@param target table
---@param ranks wsync.Ranks?
---@param rollout table?
function Steps:run(step, target, ranks, rollout)
  local moved
  -- (A together step's parts, each timed on its own as it ends, a failed one
  -- too: the entry keeps them.)
  local parts = step.kind == "together" and {} or nil
  report_module.timed(target, schedule_module.describe(step), step.kind, function()
    if not parts then
      moved = self:_part(step, ranks, rollout)
      return
    end
    local sections = {}
    local _, failed, err = loop.all(#step.parts, function(index)
      local part = step.parts[index]
      sections[index] = { steps = {} }
      local bytes = report_module.timed(sections[index], schedule_module.describe(part), part.kind, function()
        return self:_part(part, ranks, rollout)
      end)
      sections[index].steps[1].bytes = bytes
      moved = bytes and (moved or 0) + bytes or moved
    end)
    for index, section in ipairs(sections) do
      parts[index] = section.steps[1]
    end
    if failed then
      error(err, 0)
    end
  end, { where = step.where, parts = parts })
  local entry = target.steps[#target.steps]
  entry.bytes = moved
  if self.sample then
    entry.device_memory, entry.predicted_bytes = self.sample(entry.where)
  end
end

--- The steps that bring back what the ranks offloaded (onload_actor, then
--- onload_optimizer, each only when offloaded), `where` saying why ("after
--- the failed publication").
---@param where string
---@return table[]
function Steps:onloads(where)
  local steps = {}
  for _, part in ipairs({ "actor", "optimizer" }) do
    if not self.resident[part] then
      steps[#steps + 1] = schedule_module.normalize("onload_" .. part, where)
    end
  end
  return steps
end

return M
