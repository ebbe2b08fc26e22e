-- wsync.plan.schedule: step normalization, the checks that refuse a schedule that
-- makes no sense (naming the step), and the per-device memory model, checked
-- against numbers computed by hand for the tiny model.
local plan_module = require("wsync.plan")
local recipe_module = require("wsync.recipe")
local schedule = require("wsync.plan.schedule")

local KiB = 1024

local error_of = require("tests.helpers.errors").error_of

-- The tiny model, FSDP2 -> TP2, two buffers of 160 KiB.
local PLAN = plan_module.build({ family = "qwen3_moe", config = "tiny" }, { bytes = 160 * KiB, count = 2 })
local TOPOLOGY = { world = 2, tp = 2 }

-- By hand: the tiny model is 405248 bytes, so each of 2 FSDP ranks holds
-- P = 202624 bytes of parameters and as much gradient; optimizer factor 2 gives
-- 2P. A TP2 rank's resident weights: embed_tokens and lm_head 512 x 64 rows
-- (65536 bytes each), per layer qkv 64 x 64 (8192), o_proj 64 x 32 (4096),
-- q/k norms 2 x 32, router 4 x 64 (512), w13 4 x 32 x 64 (16384), w2 4 x 64 x
-- 16 (8192), layer norms 2 x 128: 37696 per layer, and the final norm 128:
-- R = 2 * 65536 + 2 * 37696 + 128 = 206592. Buffers B = 2 * 163840 = 327680;
-- the largest tensor in flight 128000; the KV arena K = 1000000.
local P, R, B, LARGEST, K = 202624, 206592, 327680, 128000, 1000000
local MEMORY = { optimizer_factor = 2, kv_bytes = K }

local USUAL = {
  "offload_optimizer",
  { wake = { "weights" } },
  "publish",
  "offload_actor",
  { wake = { "kv_cache" } },
  { sleep = 2 },
  "onload_actor",
  "onload_optimizer",
}

local function check(schedule_steps, options)
  options = options or {}
  return schedule.check({
    plan = PLAN, topology = TOPOLOGY, memory = options.memory or MEMORY,
    bootstrap = options.bootstrap or { { sleep = 1 } }, schedule = schedule_steps, budget = options.budget,
    callbacks = options.callbacks, engine = options.engine, device_bytes = options.device_bytes,
  })
end

local function refusal(schedule_steps, options)
  local err = error_of(check, schedule_steps, options)
  assert.are.equal("SCHEDULE_INVALID", err.code)
  return err
end

describe("schedule.normalize", function()
  it("reads every kind of step", function()
    assert.are.same({ kind = "publish", where = "s[1]" }, schedule.normalize("publish", "s[1]"))
    assert.are.same({ kind = "generate", where = "s[2]" }, schedule.normalize("generate", "s[2]"))
    assert.are.same({ kind = "trainer", name = "offload_actor", where = "s[3]" },
      schedule.normalize("offload_actor", "s[3]"))
    assert.are.same({ kind = "sleep", level = 2, where = "s[4]" }, schedule.normalize({ sleep = 2 }, "s[4]"))
    local wake = schedule.normalize({ wake = { "weights", "kv_cache" } }, "s[5]")
    assert.are.equal("wake", wake.kind)
    assert.is_true(wake.weights and wake.kv_cache)
    assert.are.equal("wake weights+kv_cache", schedule.describe(wake))
    local single = schedule.normalize({ wake = "kv_cache" }, "s[6]")
    assert.are.same({ "kv_cache" }, single.tags)
    assert.is_nil(single.weights)
  end)

  local bad = {
    { step = { sleep = 3 }, says = "schedule[2]: sleep level must be 1 or 2, got 3" },
    { step = { sleep = "deep" }, says = "schedule[2]: sleep level must be 1 or 2, got deep" },
    { step = { wake = { "weights", "optimizer" } }, says = "schedule[2]: unknown wake tag optimizer" },
    { step = { wake = {} }, says = "schedule[2]: wake needs at least one tag" },
    { step = 42, says = "schedule[2]: a step is a trainer callback name" },
    { step = { generate = true }, says = "schedule[2]: a step is a trainer callback name" },
  }
  for _, case in ipairs(bad) do
    it("refuses " .. case.says:match(": (.*)$"), function()
      local err = error_of(schedule.normalize, case.step, "schedule[2]")
      assert.are.equal("SCHEDULE_INVALID", err.code)
      assert.are.equal("schedule[2]", err.field)
      assert.matches(case.says, err.message, 1, true)
    end)
  end
end)

describe("schedule.check", function()
  it("passes the demo recipe's schedule", function()
    local demo = recipe_module.load("recipes/demo.lua")
    local plan = plan_module.build({ family = "qwen3_moe", config = demo.model.preset }, demo.buffers)
    local report, bootstrap, steps = schedule.check({
      plan = plan, topology = { world = demo.trainer.ranks, tp = demo.runtime.tp }, memory = demo.memory,
      bootstrap = demo.bootstrap, schedule = demo.schedule, budget = demo.memory.device_bytes,
    })
    assert.are.equal(#demo.schedule, #steps)
    assert.are.equal(#demo.bootstrap, #bootstrap)
    assert.are.equal(#demo.bootstrap + #demo.schedule, #report.steps)
    assert.is_true(report.peak <= demo.memory.device_bytes)
  end)

  it("passes the usual schedule with the callbacks the trainer registered", function()
    check(USUAL, { callbacks = { offload_optimizer = true, onload_optimizer = true, offload_actor = true,
      onload_actor = true } })
  end)

  it("refuses a step no trainer rank registered", function()
    local err = refusal(USUAL, { callbacks = { offload_optimizer = true } })
    assert.are.equal("schedule[4]", err.field)
    assert.matches("schedule[4] (offload_actor): not a callback that every trainer rank has (they have: "
      .. "offload_optimizer)", err.message, 1, true)
  end)

  it("refuses publish or generate in the bootstrap", function()
    for _, kind in ipairs({ "publish", "generate" }) do
      local err = refusal(USUAL, { bootstrap = { { sleep = 1 }, kind } })
      assert.are.equal("bootstrap[2]", err.field)
      assert.matches("bootstrap[2]: " .. kind .. " belongs in the schedule", err.message, 1, true)
    end
  end)

  it("refuses a step table with two kinds of step, or extra keys", function()
    for _, step in ipairs({ { sleep = 1, wake = { "weights" } }, { sleep = 2, level = 2 }, {} }) do
      local steps = { step }
      for _, usual in ipairs(USUAL) do
        steps[#steps + 1] = usual
      end
      local err = refusal(steps)
      assert.are.equal("schedule[1]", err.field)
      assert.matches("schedule[1]: a step is a trainer callback name", err.message, 1, true)
    end
  end)

  it("refuses to publish while generation can run, and passes it paused around the publication", function()
    local awake = { { wake = { "kv_cache" } } }
    local err = refusal({ "offload_optimizer", "publish", "generate", "onload_optimizer" }, { bootstrap = awake })
    assert.are.equal("schedule[2]", err.field)
    assert.matches("schedule[2] (publish): publish while generation can run (the kv_cache is awake and generation "
      .. "is not paused): pause it first", err.message, 1, true)
    local report = check({ "offload_optimizer", { pause = "keep", kv = "recompute" }, "publish", "resume", "generate",
      "onload_optimizer" }, { bootstrap = awake })
    assert.are.equal("pause keep (kv recompute)", report.steps[3].step) -- (after the bootstrap's wake)
    assert.are.equal("resume", report.steps[5].step)
  end)

  it("refuses pause steps that make no sense, naming them", function()
    local awake = { { wake = { "kv_cache" } } }
    for _, case in ipairs({
      { { { pause = "keep" }, { pause = "wait" }, "publish", "resume" }, "schedule[2] (pause wait): generation is "
        .. "paused already" },
      { { "resume", "publish" }, "schedule[1] (resume): resume without a pause before it" },
      { { { pause = "abort" }, "generate", "publish", "resume" }, "schedule[2] (generate): generate while generation "
        .. "is paused: resume first" },
      -- (ending paused: the next round's pause fails)
      { { { pause = "keep" }, "publish" }, "schedule[1] (pause keep): generation is paused already" },
    }) do
      assert.matches(case[2], refusal(case[1], { bootstrap = awake }).message, 1, true)
    end
    for _, case in ipairs({
      { { pause = "later" }, "pause mode must be abort, wait or keep, got later" },
      { { pause = "abort", kv = "keep" }, "kv (recompute or keep) is the KV policy of a keep-mode pause" },
      { { pause = "keep", why = 1 }, "a pause step is {pause =" },
    }) do
      assert.matches(case[2], refusal({ case[1], "publish", "resume" }, { bootstrap = awake }).message, 1, true)
    end
    assert.matches("bootstrap[1]: pause belongs in the schedule", refusal({ "publish" }, {
      bootstrap = { { pause = "keep" } } }).message, 1, true)
  end)

  it("refuses publish with the actor offloaded", function()
    local err = refusal({ "offload_actor", { wake = { "weights" } }, "publish", "onload_actor" })
    assert.are.equal("schedule[3]", err.field)
    assert.matches("schedule[3] (publish): publish needs the actor resident", err.message, 1, true)
  end)

  it("refuses publish with the rollout weights asleep", function()
    local err = refusal({ "offload_optimizer", "publish", "onload_optimizer" })
    assert.are.equal("schedule[2]", err.field)
    assert.matches("schedule[2] (publish): publish needs the rollout weights awake", err.message, 1, true)
  end)

  it("refuses to wake the KV cache before the weights", function()
    local err = refusal({ "offload_optimizer", { wake = { "kv_cache" } }, { wake = { "weights" } }, "publish",
      "onload_optimizer" })
    assert.are.equal("schedule[2]", err.field)
    assert.matches("schedule[2] (wake kv_cache): wake kv_cache needs the rollout weights awake", err.message, 1,
      true)
  end)

  it("refuses offloading twice", function()
    local err = refusal({ "offload_optimizer", { wake = { "weights" } }, "offload_optimizer", "publish",
      "onload_optimizer" })
    assert.are.equal("schedule[3]", err.field)
    assert.matches("schedule[3] (offload_optimizer): the optimizer is already offloaded", err.message, 1, true)
  end)

  it("refuses onloading what is resident", function()
    local err = refusal({ { wake = { "weights" } }, "publish", "onload_actor" })
    assert.matches("schedule[3] (onload_actor): the actor is already resident", err.message, 1, true)
  end)

  it("refuses a schedule that never publishes", function()
    local err = refusal({ "offload_optimizer", { wake = { "weights" } }, "onload_optimizer" })
    assert.are.equal("schedule", err.field)
    assert.matches("never publishes", err.message, 1, true)
  end)

  it("refuses a schedule that publishes twice, naming the second publish", function()
    local err = refusal({ { wake = { "weights" } }, "publish", "offload_optimizer", "publish", "onload_optimizer" })
    assert.are.equal("schedule[4]", err.field)
    assert.matches("schedule[4]: a second publish", err.message, 1, true)
  end)

  it("refuses a schedule that leaves the optimizer offloaded, naming the step that offloaded it", function()
    local err = refusal({ "offload_optimizer", { wake = { "weights" } }, "publish", "offload_actor", "onload_actor" })
    assert.are.equal("schedule[1]", err.field)
    assert.matches("schedule[1] (offload_optimizer) offloads the trainer's optimizer and no later step onloads it",
      err.message, 1, true)
  end)

  it("refuses a schedule that leaves the actor offloaded", function()
    local err = refusal({ { wake = { "weights" } }, "publish", "offload_actor", "offload_optimizer",
      "onload_optimizer" })
    assert.are.equal("schedule[3]", err.field)
    assert.matches("trainer's actor", err.message, 1, true)
  end)

  it("refuses a schedule that holds only for the first publication (the steady state fails)", function()
    -- Without a bootstrap the weights start awake, so the first publish may
    -- run; the schedule then discards them and the next publish may not.
    local err = refusal({ "publish", { sleep = 2 } }, { bootstrap = {} })
    assert.are.equal("schedule[1]", err.field)
    assert.matches("schedule[1] (publish): publish needs the rollout weights awake", err.message, 1, true)
  end)

  describe("memory model", function()
    it("sizes one device as computed by hand", function()
      local report = check(USUAL)
      assert.are.same({ params = P, gradients = P, optimizer = 2 * P, rollout = R, kv_cache = K, buffers = B,
        largest = LARGEST, context = 0 }, report.sizes)
    end)

    it("follows every step, and finds the peak and its step", function()
      local report = check(USUAL)
      -- (Each step: the device's bytes, the trainer rank's and the TP worker's.)
      local function step(where, name, trainer, rollout, during)
        return { where = where, step = name, bytes = during or trainer + rollout, trainer_bytes = trainer,
          rollout_bytes = rollout }
      end
      local expected = {
        step("bootstrap[1]", "sleep 1", 4 * P, 0), -- weights to host memory
        step("schedule[1]", "offload_optimizer", 2 * P, 0),
        step("schedule[2]", "wake weights", 2 * P, R),
        step("schedule[3]", "publish", 2 * P + B, R, 2 * P + R + B + LARGEST),
        step("schedule[4]", "offload_actor", B, R),
        step("schedule[5]", "wake kv_cache", B, R + K),
        step("schedule[6]", "sleep 2", B, 0),
        step("schedule[7]", "onload_actor", 2 * P + B, 0),
        step("schedule[8]", "onload_optimizer", 4 * P + B, 0),
      }
      assert.are.same(expected, report.steps)
      -- start: 4P + R = 1017088; the KV cache step: R + B + K = 1534272
      assert.are.equal(R + B + K, report.peak)
      assert.are.equal(1534272, report.peak)
      assert.are.equal("schedule[5] (wake kv_cache)", report.peak_step)
    end)

    it("puts the peak at publish when the buffers and the largest tensor in flight dominate", function()
      -- no optimizer state, no KV arena: start 2P + R = 611840, publish
      -- 2P + R + B + 128000 = 1067520, onload_optimizer 2P + B = 732928
      local report = check(USUAL, { memory = { optimizer_factor = 0, kv_bytes = 0 } })
      assert.are.equal(1067520, report.peak)
      assert.are.equal("schedule[3] (publish)", report.peak_step)
    end)

    it("refuses a budget overflow, naming the step and both byte counts", function()
      local err = refusal(USUAL, { budget = 1500000 })
      assert.are.equal("schedule[5]", err.field)
      assert.matches("schedule[5] (wake kv_cache) needs 1534272 bytes (1.46 MiB) on each device; the budget is "
        .. "1500000 bytes (1.43 MiB): 34272 bytes (33.47 KiB) over", err.message, 1, true)
    end)

    it("accepts a budget of exactly the peak", function()
      assert.are.equal(1534272, check(USUAL, { budget = 1534272 }).peak)
    end)

    it("refuses a budget below the starting state, where nothing has moved yet", function()
      local err = refusal(USUAL, { budget = 4 * P + R - 1 })
      assert.are.equal("memory.device_bytes", err.field)
      assert.matches("start (trainer and rollout weights resident) needs 1017088 bytes", err.message, 1, true)
    end)

    it("predicts each step of the first round, then of the steady state (the buffers held from the first publish)",
      function()
        local report = check(USUAL, { bootstrap = {} })
        -- (First: the rollout's weights awake, as it starts, and no buffers
        -- yet; later: the weights discarded by the sleep, the buffers held.)
        assert.are.equal(2 * P + R, schedule.predicted_bytes(report, "schedule[1]"))
        assert.are.equal(2 * P + B, schedule.predicted_bytes(report, "schedule[1]", true))
        assert.are.equal(4 * P + B, schedule.predicted_bytes(report, "schedule[8]", true))
        assert.is_nil(schedule.predicted_bytes(report, "schedule[9]"))
      end)

    it("keeps counting the buffers after the first publish", function()
      local report = check(USUAL, { bootstrap = {} })
      assert.are.equal(4 * P + B, report.steps[#report.steps].bytes)
      local err = refusal(USUAL, { bootstrap = {}, budget = 4 * P + B - 1, memory = { optimizer_factor = 2 } })
      assert.are.equal("schedule[8]", err.field)
    end)
  end)

  describe("memory model with vLLM's reservation and CUDA contexts", function()
    local GIB = 1024 ^ 3
    local C, ASLEEP = schedule.CONTEXT_BYTES, schedule.VLLM_ASLEEP_BYTES
    local VLLM = { kind = "vllm", utilization = 0.25, cuda = true }
    local DEVICE = 100 * GIB
    local RESERVED = math.floor(0.25 * DEVICE)

    it("holds the reservation while awake, what sleep leaves asleep, and a context in each process", function()
      local report = check(USUAL, { engine = VLLM, device_bytes = DEVICE })
      assert.are.equal(RESERVED, report.sizes.reservation)
      assert.are.equal(RESERVED - R - ASLEEP, report.sizes.kv_cache)
      local by_step = {}
      for _, entry in ipairs(report.steps) do
        by_step[entry.where] = entry
      end
      assert.are.equal(C + 4 * P, by_step["bootstrap[1]"].trainer_bytes)
      assert.are.equal(C + ASLEEP, by_step["bootstrap[1]"].rollout_bytes) -- asleep: weights to the host
      assert.are.equal(C + ASLEEP + R, by_step["schedule[2]"].rollout_bytes) -- its weights alone awake
      assert.are.equal(RESERVED, by_step["schedule[5]"].rollout_bytes) -- the KV cache too: all it reserved
      assert.are.equal(C + B + RESERVED, by_step["schedule[5]"].bytes)
      assert.are.equal(C + ASLEEP, by_step["schedule[6]"].rollout_bytes)
    end)

    it("starts vLLM with its KV cache reserved, as vLLM does", function()
      local report = check({ "offload_optimizer", "publish", "onload_optimizer" }, { bootstrap = {}, engine = VLLM,
        device_bytes = DEVICE })
      for _, entry in ipairs(report.steps) do
        assert.are.equal(RESERVED, entry.rollout_bytes)
      end
      assert.are.equal(C + 4 * P + B + RESERVED, report.peak)
    end)

    it("predicts what the H200 measured of vLLM 0.26 within 5% or 1 GiB (tests/bench/logs/h200-2026-12-03)",
      function()
        -- vllm_memory.log: a 1.41 GiB model at gpu_memory_utilization 0.3 of
        -- CUDA's 139.8 GiB; the EngineCore process's memory per state (awake:
        -- at its start, 42.49, and woken again, 42.06).
        local measured = { awake = 42.490, woken = 42.06, asleep = 1.076, weights = 2.500 }
        local sizes = schedule.sizes(PLAN, TOPOLOGY, {}, { kind = "vllm", utilization = 0.3, cuda = true },
          139.8 * GIB)
        local weights = 1.41 * GIB
        local predicted = { awake = sizes.reservation, woken = sizes.reservation, asleep = sizes.context + sizes.asleep,
          weights = sizes.context + sizes.asleep + weights }
        for state, gib in pairs(measured) do
          local off = math.abs(predicted[state] - gib * GIB)
          assert.is_true(off <= math.max(0.05 * gib * GIB, GIB),
            string.format("%s: predicted %.3f GiB, measured %.3f GiB", state, predicted[state] / GIB, gib))
        end
      end)

    it("models vLLM's reservation on a GPU only (on the host backend the vllm runtime runs a stand-in engine)",
      function()
        assert.are.same({ kind = "vllm", cuda = true, utilization = 0.9 },
          schedule.engine_of({ backend = "cuda", runtime = { kind = "vllm" } }))
        local vllm = { kind = "vllm", vllm = { gpu_memory_utilization = 0.3 } }
        assert.are.same({ kind = "vllm", cuda = true, utilization = 0.3 },
          schedule.engine_of({ backend = "cuda", runtime = vllm }))
        assert.are.same({ kind = "vllm", cuda = false }, schedule.engine_of({ backend = "host",
          runtime = { kind = "vllm", vllm = { gpu_memory_utilization = 0.3 } } }))
        assert.are.same({ kind = "reference", cuda = false }, schedule.engine_of({ backend = "host" }))
      end)

    it("leaves the optimizer's state out of the start when the first step makes it (memory.optimizer_at_start)",
      function()
        local memory = { optimizer_factor = 2, kv_bytes = K, optimizer_at_start = false }
        local report = check(USUAL, { memory = memory, engine = VLLM, device_bytes = DEVICE })
        -- (start: the actor and vLLM's reservation; the bootstrap's sleep; then
        -- the first step makes 2P of optimizer state beside the sleeping vLLM.)
        assert.are.same({ bytes = C + 4 * P + C + ASLEEP, trainer_bytes = C + 4 * P, rollout_bytes = C + ASLEEP },
          report.first_step)
        assert.are.equal(C + 2 * P + RESERVED, report.peak) -- (the start: the actor beside all vLLM reserved)
        -- Without the bootstrap's sleep, the first step's optimizer state
        -- meets vLLM's whole reservation: refused, naming the field.
        local err = refusal(USUAL, { bootstrap = {}, memory = memory, engine = VLLM, device_bytes = DEVICE,
          budget = C + 2 * P + RESERVED + P })
        assert.are.equal("memory.optimizer_at_start", err.field)
        assert.matches("the first train_step (it makes the optimizer's state) needs ", err.message, 1, true)
        assert.matches(": " .. string.format("%d", P) .. " bytes %([%d.]+ KiB%) over$", err.message)
      end)

    it("says vLLM's reservation is not modelled where the device's total is not known", function()
      local report = check(USUAL, { engine = VLLM })
      assert.is_nil(report.sizes.reservation)
      assert.matches("gpu_memory_utilization 0.25 of the device", report.sizes.unmodelled, 1, true)
    end)

    it("refuses a trainer and vLLM's reservation that do not fit beside each other, naming the bytes over", function()
      -- (The optimizer state alone is 80% of the device: vLLM's 25% does not
      -- fit beside it when vLLM starts.)
      local memory = { optimizer_factor = 0.8 * DEVICE / P, kv_bytes = K }
      local err = refusal(USUAL, { engine = VLLM, device_bytes = DEVICE, budget = DEVICE, memory = memory })
      assert.are.equal("memory.device_bytes", err.field)
      -- (Over: the trainer's context, the actor, 80 GiB of optimizer state and
      -- 25 GiB reserved (vLLM's context in it), less the 100 GiB: 5.5 GiB and
      -- the actor's 0.39 MiB.)
      local over = C + 2 * P + 0.8 * DEVICE + RESERVED - DEVICE
      assert.matches("start (trainer and rollout weights resident) needs ", err.message, 1, true)
      assert.matches(string.format("the budget is %d bytes (100.00 GiB): %d bytes (5.50 GiB) over", DEVICE, over),
        err.message, 1, true)
    end)
  end)
end)

describe("together steps (a trainer callback beside a rollout step)", function()
  local TOGETHER = {
    "offload_optimizer",
    { wake = { "weights" } },
    "publish",
    { together = { { wake = { "kv_cache" } }, "offload_actor" } },
    { together = { "onload_actor", { sleep = 2 } } },
    "onload_optimizer",
  }

  it("reads the trainer callback first, whatever the order written, and names both", function()
    local step = schedule.normalize({ together = { { wake = { "kv_cache" } }, "offload_actor" } }, "s[4]")
    assert.are.equal("together", step.kind)
    assert.are.same({ kind = "trainer", name = "offload_actor", where = "s[4].together[2]" }, step.parts[1])
    assert.are.equal("wake", step.parts[2].kind)
    assert.are.equal("offload_actor + wake kv_cache", schedule.describe(step))
  end)

  it("refuses anything but one trainer callback and one sleep, wake, pause or resume, naming the step", function()
    for _, case in ipairs({
      { step = { together = { "offload_actor", "onload_optimizer" } }, says = "together[2] is a second trainer" },
      { step = { together = { "offload_actor", "publish" } }, says = "together[2] is a publish step" },
      { step = { together = { "generate", { sleep = 2 } } }, says = "together[1] is a generate step" },
      { step = { together = { "offload_actor" } }, says = "a together step is {together = " },
      { step = { together = { "offload_actor", { sleep = 2 } }, sleep = 1 }, says = "a together step is" },
      { step = { together = { { together = { "a", { sleep = 1 } } }, { sleep = 2 } } },
        says = "together[1] is a together step" },
    }) do
      local err = error_of(schedule.normalize, case.step, "schedule[2]")
      assert.are.equal("SCHEDULE_INVALID", err.code)
      assert.are.equal("schedule[2]", err.field)
      assert.matches(case.says, err.message, 1, true)
    end
  end)

  it("ends where the two steps one after the other end, and peaks at the most either order holds between them",
    function()
      local apart = check(USUAL)
      local report = check(TOGETHER)
      local by_where = {}
      for _, entry in ipairs(report.steps) do
        by_where[entry.where] = entry
      end
      -- (offload_actor beside wake kv_cache: the KV arena woken while the
      -- actor (parameters and gradients, 2P) is still resident is the peak;
      -- after both, as after the two apart.)
      local after_wake = apart.steps[6] -- (bootstrap[1], then schedule[5]: wake kv_cache)
      assert.are.equal("schedule[5]", after_wake.where)
      assert.are.equal(after_wake.bytes + 2 * P, by_where["schedule[4]"].bytes)
      assert.are.equal(after_wake.trainer_bytes, by_where["schedule[4]"].trainer_bytes)
      assert.are.equal(after_wake.rollout_bytes, by_where["schedule[4]"].rollout_bytes)
      -- (onload_actor beside sleep 2: the actor back while the KV arena is
      -- still awake.)
      assert.are.equal(after_wake.bytes + 2 * P, by_where["schedule[5]"].bytes)
      assert.are.equal(math.max(apart.peak, after_wake.bytes + 2 * P), report.peak)
    end)

  it("refuses a together step that does not fit in either order, naming it and the bytes over", function()
    local fits = check(TOGETHER)
    local err = refusal(TOGETHER, { budget = fits.steps[5].bytes - 1 })
    assert.are.equal("schedule[4]", err.field)
    assert.matches("schedule[4] (offload_actor + wake kv_cache) needs ", err.message, 1, true)
    assert.matches(": 1 bytes %(1 B%) over$", err.message)
  end)

  it("keeps a pause or resume out of the bootstrap inside a together step too", function()
    local err = refusal(USUAL, { bootstrap = { { together = { "offload_actor", { pause = "keep" } } } } })
    assert.matches("bootstrap[1]: pause belongs in the schedule", err.message, 1, true)
  end)
end)

describe("schedule.predicted_bytes", function()
  it("predicts a together step's memory after both parts, not its peak while they run", function()
    local report = check({ "offload_optimizer", { wake = { "weights" } }, "publish",
      { together = { "offload_actor", { wake = { "kv_cache" } } } }, { together = { "onload_actor", { sleep = 2 } } },
      "onload_optimizer" })
    local entry = report.steps[5]
    assert.are.equal("schedule[4]", entry.where)
    assert.are.equal(entry.trainer_bytes + entry.rollout_bytes, schedule.predicted_bytes(report, "schedule[4]"))
    assert.is_true(entry.bytes > schedule.predicted_bytes(report, "schedule[4]"))
    assert.are.equal(report.steps[4].bytes, schedule.predicted_bytes(report, "schedule[3]")) -- (publish: its peak)
  end)
end)
