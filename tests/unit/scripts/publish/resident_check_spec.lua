-- wsync.publish.resident_check: which check a recipe's verify mode runs, on
-- fake ranks and runtimes (no processes): the requests it makes, the loader
-- plans it makes once, the counts over replicas, the refusal it passes on.
local resident_check = require("wsync.publish.resident_check")

local CONFIG = {
  vocab_size = 64, hidden_size = 8, moe_intermediate_size = 4, num_hidden_layers = 1, num_attention_heads = 2,
  num_key_value_heads = 1, head_dim = 4, num_experts = 2, tie_word_embeddings = false,
}

-- A runtime of `replicas` replicas whose answer to each command is `answers[cmd]`.
local function rollout(replicas, answers)
  local fake = { asked = {} }
  function fake.request(_, cmd, payload)
    fake.asked[#fake.asked + 1] = { cmd = cmd, payload = payload }
    return answers[cmd]
  end
  function fake.by_replica(_, reported)
    local lists = {}
    for index = 1, replicas do
      lists[index] = reported.workers
    end
    return lists
  end
  return fake
end

local function check_with(mode, transport, ranks)
  return resident_check.new({ mode = mode, plan = { family = "qwen3_moe", config = CONFIG }, tp = 2,
    ranks = ranks or {}, transport = transport or {}, timeouts = { values_sums = 5 } })
end

describe("wsync.publish.resident_check", function()
  local saved
  before_each(function()
    saved = package.loaded["wsync.plan.values"]
  end)
  after_each(function()
    package.loaded["wsync.plan.values"] = saved
  end)

  it("checks the trainer's values: the ranks' sums against every replica's, the loader plans made once", function()
    local asked, checked = {}, {}
    local ranks = {
      all = function(_, cmd, payload_of, timeout)
        asked[#asked + 1] = { cmd = cmd, payload = payload_of(), timeout = timeout }
        return { { workers = "rank 0's sums" }, { workers = "rank 1's sums" } }
      end,
    }
    package.loaded["wsync.plan.values"] = {
      check = function(loaders, by_rank, workers)
        checked[#checked + 1] = { loaders = loaders, by_rank = by_rank, workers = workers }
        return { workers = 2, tensors = 7 }
      end,
    }
    local check = check_with("values", nil, ranks)
    local runtime = rollout(3, { resident_values = { workers = "held" } })
    assert.are.same({ workers = 6, tensors = 21 }, check:check(runtime, 4))
    assert.are.same({ { cmd = "values_sums", payload = { family = "qwen3_moe", config = CONFIG, tp = 2 },
      timeout = 5 } }, asked)
    assert.are.same({ { cmd = "resident_values", payload = {} } }, runtime.asked)
    assert.are.equal(3, #checked)
    assert.are.same({ "rank 0's sums", "rank 1's sums" }, checked[1].by_rank)
    assert.are.equal(2, #checked[1].loaders)
    local loaders = checked[1].loaders
    check:check(runtime, 5)
    assert.are.equal(loaders, checked[4].loaders) -- (made once, kept)
  end)

  it("checks synthetic values on the device where the transport can", function()
    local check = check_with(true, { CAPABILITIES = { device_check = true }, check_synthetic = function() end })
    local runtime = rollout(1, { resident_check = { workers = {
      { ops = 3, checked = 30, mismatches = 0 }, { ops = 2, checked = 20, mismatches = 0 } } } })
    assert.are.same({ workers = 2, slices = 5, elements = 50 }, check:check(runtime, 7))
    assert.are.same({ { cmd = "resident_check", payload = { step = 7 } } }, runtime.asked)
  end)

  it("passes on the device check's refusal, naming the worker", function()
    local check = check_with(true, { CAPABILITIES = { device_check = true }, check_synthetic = function() end })
    local runtime = rollout(1, { resident_check = { workers = {
      { ops = 3, checked = 30, mismatches = 0 }, { ops = 2, checked = 20, mismatches = 4, op = 1, element = 9 } } } })
    local ok, err = pcall(check.check, check, runtime, 7)
    assert.is_false(ok)
    assert.are.equal("VERIFY_RESIDENT", err.code)
    assert.are.equal(1, err.rank)
    assert.matches("TP worker 1 holds 4 elements that are not step 7's values", err.message, 1, true)
  end)

  it("checks synthetic checksums elsewhere, and refuses a worker that holds other bytes", function()
    local recipe_module = require("wsync.recipe")
    local plan = require("wsync.recipe.prepare").prepare(recipe_module.load("recipes/demo.lua"),
      { plan_only = true })
    local verify = require("wsync.publish.verify")
    local check = resident_check.new({ mode = true, plan = plan, tp = 2, ranks = {}, transport = {}, timeouts = {} })
    local held = { { tensors = verify.expected(plan, 2, 0, 2) }, { tensors = verify.expected(plan, 2, 1, 2) } }
    local runtime = rollout(2, { resident_checksums = { workers = held } })
    local counted = check:check(runtime, 2)
    assert.are.equal(4, counted.workers)
    assert.is_true(counted.tensors > 0)
    assert.are.same({ cmd = "resident_checksums", payload = {} }, runtime.asked[1])
    local ok, err = pcall(check.check, check, runtime, 3) -- (step 3's values: not what they hold)
    assert.is_false(ok)
    assert.are.equal("VERIFY_RESIDENT", err.code)
    assert.are.equal(0, err.rank)
  end)
end)
