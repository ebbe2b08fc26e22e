-- wsync.recipe.prepare: a model recipe's plan, topology and schedule, and
-- the check that `wsync check` and `wsync run` make of any recipe, whose
-- failures name the recipe's file, line and field.
local fields = require("wsync.recipe.fields")
local load_module = require("wsync.recipe.load")
local prepare_module = require("wsync.recipe.prepare")
local schema = require("wsync.recipe.schema")
local fixtures = require("tests.helpers.fixtures")
local recipes = require("tests.helpers.recipes")

local error_of = require("tests.helpers.errors").error_of
local model_recipe = recipes.model

describe("prepare", function()
  it("is auto unless given: gates on the cuda backend's packed buffers, required with device", function()
    local prepare = prepare_module.prepare
    local host = assert(schema.check(fields.schema, model_recipe()))
    assert.are.equal("auto", host.buffers.order)
    assert.is_nil(prepare(host, { plan_only = true }).gated)
    local auto = assert(schema.check(fields.schema, model_recipe({ backend = "cuda" })))
    local plan = prepare(auto, { plan_only = true })
    assert.is_true(plan.gated)
    assert.is_nil(plan.ordered)
    local device = assert(schema.check(fields.schema, model_recipe({ backend = "cuda",
      buffers = { order = "device" } })))
    plan = prepare(device, { plan_only = true })
    assert.is_true(plan.gated and plan.ordered)
    local unordered = assert(schema.check(fields.schema, model_recipe({ backend = "cuda",
      buffers = { order = "host" } })))
    assert.is_nil(prepare(unordered, { plan_only = true }).gated)
    local direct = assert(schema.check(fields.schema, model_recipe({ backend = "cuda", trainer = { ranks = 1 },
      runtime = { tp = 1 }, buffers = { direct = true } })))
    assert.is_nil(prepare(direct, { plan_only = true }).gated)
  end)

  it("models a CUDA context in each process on the cuda backend (memory.context_bytes, or the default), none on the "
    .. "host", function()
    local schedule = require("wsync.plan.schedule")
    local function context(changes)
      local _, _, report = prepare_module.prepare(assert(schema.check(fields.schema, model_recipe(changes))),
        { plan_only = true })
      return report.sizes.context
    end
    assert.are.equal(0, context())
    assert.are.equal(schedule.CONTEXT_BYTES, context({ backend = "cuda" }))
    assert.are.equal(300 * 2 ^ 20, context({ backend = "cuda", memory = { context_bytes = 300 * 2 ^ 20 } }))
  end)

  it("plans a vllm rollout in FP8 through vLLM's own loader or wsync's, and refuses what it cannot plan", function()
    local function recipe(vllm, load, check)
      vllm.gpu_memory_utilization = 0.1
      return assert(schema.check(fields.schema, model_recipe({ backend = "cuda",
        memory = { device_bytes = 16 * 2 ^ 30 },
        runtime = { kind = "vllm", load = load, vllm = vllm, model = "models/tiny", check = check } })))
    end
    local _, _, report = prepare_module.prepare(recipe({ quantization = "fp8" }, "native"), { plan_only = true })
    local bf16 = select(3, prepare_module.prepare(recipe({}, "native"), { plan_only = true }))
    assert.is_true(report.sizes.rollout < bf16.sizes.rollout) -- (float8 weights: what vLLM holds shrinks)
    -- (wsync's direct loader quantizes while it copies: the plan keeps each
    -- layer's q, k and v, under one scale, in one chunk.)
    local plan, _, direct = prepare_module.prepare(recipe({ quantization = "fp8" }, "direct", "never"),
      { plan_only = true })
    assert.are.equal("fp8", plan.quantization)
    assert.are.equal(report.sizes.rollout, direct.sizes.rollout)
    -- (Its check against vLLM's own FP8 loader runs in the worker: planned.)
    local checked = select(3, prepare_module.prepare(recipe({ quantization = "fp8" }, "direct"), { plan_only = true }))
    assert.are.equal(report.sizes.rollout, checked.sizes.rollout)
    local err
    err = error_of(prepare_module.prepare, recipe({ quantization = "awq" }, "native"), { plan_only = true })
    assert.are.equal("runtime.vllm.quantization", err.field)
    assert.matches("quantization awq: wsync plans bfloat16 rollouts and \"fp8\"", err.message, 1, true)
  end)

  it("plans the reference runtime holding FP8 (runtime.quantization), and refuses the values check of it", function()
    local plan = prepare_module.prepare(assert(schema.check(fields.schema, model_recipe({
      runtime = { kind = "reference", tp = 2, quantization = "fp8" } }))), { plan_only = true })
    assert.are.equal("fp8", plan.quantization)
    local err = error_of(prepare_module.prepare, assert(schema.check(fields.schema, model_recipe({ verify = "values",
      runtime = { kind = "reference", tp = 2, quantization = "fp8" } }))), { plan_only = true })
    assert.are.equal("verify", err.field)
    assert.matches("verify = \"values\" sums the trainer's bfloat16 values, and under quantization fp8",
      err.message, 1, true)
    local _, refusal = schema.check(fields.schema, model_recipe({ backend = "cuda", runtime = { kind = "vllm",
      model = "models/tiny", quantization = "fp8" } }))
    assert.are.equal("runtime.quantization", refusal.path)
    assert.matches("is the reference runtime's; the vllm runtime's quantization is its engine's", refusal.message, 1,
      true)
  end)

  it("knows the synthetic trainer's callbacks before its ranks register, not an external trainer's", function()
    assert.are.same({ offload_optimizer = true, onload_optimizer = true, offload_actor = true, onload_actor = true },
      prepare_module.known_callbacks(recipes.validated()))
    assert.is_nil(prepare_module.known_callbacks(recipes.validated({ trainer = { kind = "external" } })))
  end)
end)

describe("check", function()
  local function loaded(path)
    return load_module.load(path)
  end

  it("refuses a recipe with nothing to run at its return line", function()
    local path = fixtures.recipes .. "/no_model.lua"
    local err = error_of(prepare_module.check, loaded(path))
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.are.equal(path, err.file)
    assert.are.equal(fixtures.bad_line(path), err.line)
    assert.are.equal("the recipe has nothing to run: it defines neither `run` nor `model`", err.message)
  end)

  it("passes a run recipe without a plan and returns a model recipe's plan", function()
    assert.is_nil(prepare_module.check(loaded(fixtures.recipes .. "/good.lua")))
    local plan, topology, memory = prepare_module.check(loaded("recipes/demo.lua"))
    assert.are.equal(3, #plan.chunks)
    assert.are.same({ world = 2, tp = 2, replicas = 1 }, topology)
    assert.is_number(memory.peak)
  end)

  it("refuses a runtime this build lacks, naming runtime.kind at its line", function()
    local path = fixtures.recipes .. "/runtime_transformers.lua"
    local err = error_of(prepare_module.check, loaded(path))
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.are.equal("runtime.kind", err.field)
    assert.are.equal(fixtures.bad_line(path), err.line)
  end)



  it("with plan_only checks the plan of a recipe this build cannot serve", function()
    local plan = prepare_module.check(loaded(fixtures.recipes .. "/backend_cuda.lua"), { plan_only = true })
    assert.are.equal(3, #plan.chunks)
    local err = error_of(prepare_module.check, loaded(fixtures.recipes .. "/backend_cuda.lua"))
    assert.are.equal("backend", err.field)
  end)
end)

describe("check_plan", function()
  it("names the schedule step that the schedule refuses, and the command line that set it", function()
    local err = error_of(prepare_module.check_plan, load_module.load("recipes/demo.lua",
      { schedule = '{ "publish", { sleep = 3 } }' }), { plan_only = true })
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.are.equal("schedule[2]", err.field)
    assert.are.equal("schedule[2]: sleep level must be 1 or 2, got 3 (set on the command line: "
      .. 'schedule={ "publish", { sleep = 3 } })', err.message)
  end)
end)
