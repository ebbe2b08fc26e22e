-- wsync.publish.verify: the independent check of what TP workers hold after a
-- publication of synthetic weights.
local errors = require("wsync.errors")
local plan_module = require("wsync.plan")
local qwen3_moe = require("wsync.plan.qwen3_moe")
local verify = require("wsync.publish.verify")

local PLAN = plan_module.build({ family = "qwen3_moe", config = "tiny" }, { bytes = 160 * 1024, count = 2 })

local function names(sums)
  local list = {}
  for name in pairs(sums) do
    list[#list + 1] = name
  end
  table.sort(list)
  return list
end

-- What a healthy TP2 runtime would report at `step`.
local function reported(step)
  local workers = {}
  for rank = 0, 1 do
    workers[rank + 1] = { rank = rank, tensors = verify.expected(PLAN, 2, rank, step) }
  end
  return workers
end

describe("verify.expected", function()
  it("gives a SHA-256 for every resident tensor of the rank", function()
    for rank = 0, 1 do
      local sums = verify.expected(PLAN, 2, rank, 1)
      local loader = qwen3_moe.loader_plan(PLAN.config, 2, rank)
      local want = {}
      for _, tensor in ipairs(loader.tensors) do
        want[#want + 1] = tensor.name
      end
      table.sort(want)
      assert.are.same(want, names(sums))
      for _, sum in pairs(sums) do
        assert.matches("^%x+$", sum)
        assert.are.equal(64, #sum)
      end
    end
  end)

  it("is deterministic", function()
    assert.are.same(verify.expected(PLAN, 2, 1, 2), verify.expected(PLAN, 2, 1, 2))
  end)

  it("differs between steps for every tensor", function()
    local one, two = verify.expected(PLAN, 2, 0, 1), verify.expected(PLAN, 2, 0, 2)
    for name, sum in pairs(one) do
      assert.are_not.equal(sum, two[name], name)
    end
  end)

  it("differs between ranks for the split tensors and agrees for the replicated ones", function()
    local zero, one = verify.expected(PLAN, 2, 0, 1), verify.expected(PLAN, 2, 1, 1)
    local replicated = {
      ["model.norm.weight"] = true,
      ["model.layers.0.self_attn.q_norm.weight"] = true,
      ["model.layers.1.mlp.gate.weight"] = true,
      ["model.layers.1.input_layernorm.weight"] = true,
    }
    for name, sum in pairs(zero) do
      if replicated[name] then
        assert.are.equal(sum, one[name], name)
      elseif name:match("qkv_proj") or name:match("o_proj") or name:match("w13") or name:match("w2")
        or name:match("embed") or name:match("lm_head") then
        assert.are_not.equal(sum, one[name], name)
      end
    end
  end)
end)

describe("verify.check", function()
  it("accepts what a healthy runtime reports and counts what it checked", function()
    assert.are.same({ workers = 2, tensors = 42 }, verify.check(PLAN, 2, 3, reported(3)))
  end)

  it("raises VERIFY_RESIDENT naming the TP rank and the tensor when one checksum differs", function()
    local workers = reported(2)
    local tensor = "model.layers.1.mlp.experts.w2_weight"
    workers[2].tensors[tensor] = string.rep("0", 64)
    local ok, err = pcall(verify.check, PLAN, 2, 2, workers)
    assert.is_false(ok)
    assert.is_true(errors.is(err), tostring(err))
    assert.are.equal("VERIFY_RESIDENT", err.code)
    assert.are.equal(1, err.rank)
    assert.are.equal(tensor, err.tensor)
    assert.matches("TP worker 1 holds " .. tensor .. " with SHA-256 " .. string.rep("0", 64), err.message, 1, true)
    assert.matches("step 2's values", err.message, 1, true)
  end)

  it("catches a worker that holds the previous step's values", function()
    local workers = reported(3)
    workers[1] = reported(2)[1]
    local ok, err = pcall(verify.check, PLAN, 2, 3, workers)
    assert.is_false(ok)
    assert.are.equal("VERIFY_RESIDENT", err.code)
    assert.are.equal(0, err.rank)
  end)

  it("catches a worker that reports nothing", function()
    local workers = reported(1)
    workers[2] = nil
    local ok, err = pcall(verify.check, PLAN, 2, 1, workers)
    assert.is_false(ok)
    assert.are.equal(1, err.rank)
    assert.matches("SHA-256 nil", err.message, 1, true)
  end)
end)
