-- wsync.publish.ranks: what each trainer rank registered, checked against the
-- plan's trainer layout (as it registers, and the ranks' rows together).
local plan_module = require("wsync.plan")
local ranks_module = require("wsync.publish.ranks")
local error_of = require("tests.helpers.errors").error_of

local plan = plan_module.build({ family = "qwen3_moe", config = "tiny" }, { bytes = 1024 * 1024 })

-- The plan's layout as rank `rank` of `world` registers it (dim-0 rows split
-- evenly, the last rank taking the rest), with `change(tensors)` applied.
local function registration(rank, world, change)
  local tensors = {}
  for index, tensor in ipairs(plan.layout) do
    local rows = math.floor(tensor.shape[1] / world)
    local first = rank * rows
    if rank == world - 1 then
      rows = tensor.shape[1] - first
    end
    tensors[index] = { name = tensor.name, dtype = tensor.dtype, shape = { unpack(tensor.shape) },
      rows = { first, rows } }
  end
  if change then
    change(tensors)
  end
  return tensors
end

local function ranks_of(world, change_of)
  local registered = {}
  for rank = 0, world - 1 do
    registered[rank] = { peer = {}, info = { tensors = registration(rank, world, change_of and change_of[rank]) } }
  end
  return ranks_module.new(registered, world)
end

describe("wsync.publish.ranks.check_tensors", function()
  it("takes the plan's layout", function()
    ranks_module.check_tensors(plan, 0, registration(0, 1))
  end)

  for _, case in ipairs({
    { what = "a missing tensor", change = function(tensors)
      table.remove(tensors, 3)
    end, says = "trainer rank 1 did not register " .. plan.layout[3].name, tensor = plan.layout[3].name },
    { what = "an extra tensor", change = function(tensors)
      tensors[#tensors + 1] = { name = "model.extra.weight", dtype = "bfloat16", shape = { 4 }, rows = { 0, 4 } }
    end, says = "trainer rank 1 registered model.extra.weight, which the qwen3_moe plan does not export",
      tensor = "model.extra.weight" },
    { what = "a wrong shape", change = function(tensors)
      tensors[2].shape[1] = tensors[2].shape[1] + 1
    end, says = string.format("trainer rank 1 registered %s as %s %dx%d; the model config says %s %dx%d",
      plan.layout[2].name, plan.layout[2].dtype, plan.layout[2].shape[1] + 1, plan.layout[2].shape[2],
      plan.layout[2].dtype, plan.layout[2].shape[1], plan.layout[2].shape[2]), tensor = plan.layout[2].name },
    { what = "a wrong dtype", change = function(tensors)
      tensors[1].dtype = "float32"
    end, says = "trainer rank 1 registered " .. plan.layout[1].name .. " as float32", tensor = plan.layout[1].name },
  }) do
    it("refuses " .. case.what .. ", naming the rank and the tensor", function()
      local err = error_of(ranks_module.check_tensors, plan, 1, registration(1, 2, case.change))
      assert.are.equal("REGISTER", err.code)
      assert.are.equal("registration", err.phase)
      assert.are.equal(1, err.rank)
      assert.are.equal(case.tensor, err.tensor)
      assert.matches(case.says, err.message, 1, true)
    end)
  end
end)

describe("wsync.publish.ranks:check_registration", function()
  it("takes ranks whose rows cover every tensor once", function()
    ranks_of(2):check_registration(plan)
  end)

  it("refuses rows that leave a gap or overlap, naming the tensor", function()
    local name = plan.layout[1].name
    local err = error_of(function()
      ranks_of(2, { [1] = function(tensors)
        tensors[1].rows = { tensors[1].rows[1] + 1, tensors[1].rows[2] - 1 }
      end }):check_registration(plan)
    end)
    assert.are.equal("REGISTER", err.code)
    assert.are.equal(name, err.tensor)
    assert.are.equal(1, err.rank)
    assert.matches(name .. ": rank 1's rows start at", err.message, 1, true)
  end)

  it("checks each rank's tensors too", function()
    local err = error_of(function()
      ranks_of(2, { [0] = function(tensors)
        table.remove(tensors)
      end }):check_registration(plan)
    end)
    assert.are.equal(0, err.rank)
    assert.matches("trainer rank 0 did not register ", err.message, 1, true)
  end)
end)
