-- wsync.publish.steps: each kind of schedule step on fake ranks and a fake
-- runtime (what each asks, with what payload), timed into a report's round,
-- a failed step recorded and raised, and what the trainers hold after their
-- callbacks (the onloads a failed round gives back).
local errors = require("wsync.errors")
local schedule_module = require("wsync.plan.schedule")
local steps_module = require("wsync.publish.steps")
local error_of = require("tests.helpers.errors").error_of

-- Ranks and a runtime that record what they are asked; `failing` names a
-- command that fails.
local function fakes(failing)
  local asked = {}
  local function ask(cmd, payload, timeout)
    asked[#asked + 1] = { cmd = cmd, payload = payload, timeout = timeout }
    if cmd == failing then
      errors.raise("RUNTIME_FAILED", cmd .. " failed")
    end
  end
  local ranks = { all = function(_, cmd, payload_of, timeout)
    ask(cmd, payload_of(0), timeout)
    return { {}, {} } -- (two ranks, whose callbacks said nothing of bytes)
  end }
  local rollout = {
    request = function(_, cmd, payload)
      ask(cmd, payload)
    end,
    pause = function(_, payload)
      ask("pause", payload)
    end,
  }
  return ranks, rollout, asked
end

local function normalized(step, where)
  return schedule_module.normalize(step, where or "schedule[1]")
end

describe("wsync.publish.steps", function()
  it("runs each kind of step on the ranks or the runtime, timed into the round as the schedule names it", function()
    local ranks, rollout, asked = fakes()
    local steps = steps_module.new(42)
    local round = { steps = {} }
    for index, step in ipairs({ "offload_optimizer", { sleep = 2 }, { wake = { "weights" } }, "generate",
      { pause = "keep", kv = "recompute" }, "resume" }) do
      steps:run(normalized(step, "schedule[" .. index .. "]"), round, ranks, rollout)
    end
    assert.are.same({
      { cmd = "callback", payload = { name = "offload_optimizer" }, timeout = 42 },
      { cmd = "sleep", payload = { level = 2 } },
      { cmd = "wake", payload = { tags = { "weights" } } },
      { cmd = "generate", payload = {} },
      { cmd = "pause", payload = { mode = "keep", kv = "recompute" } },
      { cmd = "resume", payload = {} },
    }, asked)
    assert.are.equal(6, #round.steps)
    for index, entry in ipairs(round.steps) do
      assert.are.equal("schedule[" .. index .. "]", entry.where)
      assert.are.equal("ok", entry.outcome)
    end
    assert.are.equal(schedule_module.describe(normalized("offload_optimizer")), round.steps[1].name)
    assert.are.equal("trainer", round.steps[1].kind)
    assert.are.equal("sleep", round.steps[2].kind)
  end)

  it("records a failed step in the round and raises its error", function()
    local ranks, rollout = fakes("wake")
    local round = { steps = {} }
    local err = error_of(steps_module.new(1).run, steps_module.new(1), normalized({ wake = { "kv_cache" } }), round,
      ranks, rollout)
    assert.are.equal("RUNTIME_FAILED", err.code)
    assert.are.equal("failed", round.steps[1].outcome)
  end)

  it("keeps what the trainers hold, and gives back what they offloaded", function()
    local ranks, rollout = fakes()
    local steps = steps_module.new(1)
    local round = { steps = {} }
    assert.are.same({}, steps:onloads("after the failed publication"))
    steps:run(normalized("offload_actor"), round, ranks, rollout)
    steps:run(normalized("offload_optimizer"), round, ranks, rollout)
    assert.are.same({ actor = false, optimizer = false }, steps.resident)
    assert.are.same({ normalized("onload_actor", "after the failed publication"),
      normalized("onload_optimizer", "after the failed publication") }, steps:onloads("after the failed publication"))
    steps:run(normalized("onload_actor"), round, ranks, rollout)
    assert.are.same({ normalized("onload_optimizer", "after") }, steps:onloads("after"))
    -- (A callback without a known effect moves nothing.)
    steps:run(normalized("save_checkpoint"), round, ranks, rollout)
    assert.are.same({ actor = true, optimizer = false }, steps.resident)
  end)

  it("keeps the memory sampled after each step that ran, and samples nothing after one that failed", function()
    local ranks, rollout = fakes("sleep")
    local steps, round, samples = steps_module.new(30), { steps = {} }, 0
    steps:run(normalized({ wake = { "weights" } }), round, ranks, rollout)
    assert.is_nil(round.steps[1].device_memory)
    local asked
    steps:sample_memory_with(function(where)
      samples, asked = samples + 1, where
      return { { device = "gpu-a", used_bytes = samples } }, 1000
    end)
    steps:run(normalized("offload_optimizer"), round, ranks, rollout)
    assert.are.same({ { device = "gpu-a", used_bytes = 1 } }, round.steps[2].device_memory)
    assert.are.equal(1000, round.steps[2].predicted_bytes) -- (the model's, for the step it names)
    assert.are.equal("schedule[1]", asked)
    assert.has_error(function()
      steps:run(normalized({ sleep = 2 }), round, ranks, rollout)
    end)
    assert.are.equal("failed", round.steps[3].outcome)
    assert.is_nil(round.steps[3].device_memory)
    assert.are.equal(1, samples)
  end)

  it("adds up the bytes the ranks' callbacks said they moved, where any said", function()
    local answers
    local ranks = { all = function()
      return answers
    end }
    local steps, round = steps_module.new(30), { steps = {} }
    answers = { { bytes = 3 * 2 ^ 30 }, { bytes = 2 ^ 30 } }
    steps:run(normalized("offload_optimizer"), round, ranks, nil)
    answers = { {}, { bytes = 5 } }
    steps:run(normalized("onload_optimizer", "schedule[2]"), round, ranks, nil)
    answers = { {}, {} }
    steps:run(normalized("onload_actor", "schedule[3]"), round, ranks, nil)
    assert.are.same({ 4 * 2 ^ 30, 5 }, { round.steps[1].bytes, round.steps[2].bytes })
    assert.is_nil(round.steps[3].bytes)
  end)
end)

