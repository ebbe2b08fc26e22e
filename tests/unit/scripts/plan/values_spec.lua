-- wsync.plan.values: the ranks' sums of their own rows add up to what each TP
-- worker holds, whatever the split, and one changed element anywhere is
-- found, naming the worker and the tensor. The tiny Qwen3-MoE, two trainer
-- ranks with uneven dim-0 shards (torch.chunk's split), TP2; the workers'
-- resident storage is laid out by the loader plan from the full canonical
-- tensors, assembled here from the shards.
local ffi = require("ffi")
local copy_module = require("wsync.native.copy")
local plan_module = require("wsync.plan")
local shm = require("wsync.native.shm")
local values = require("wsync.plan.values")

local WORLD, TP = 2, 2

-- Deterministic bytes: a xorshift stream.
local function fill_random(memory, bytes, seed)
  local pointer = ffi.cast("uint8_t *", memory:pointer())
  local state = seed
  for i = 0, bytes - 1 do
    state = bit.bxor(state, bit.lshift(state, 13))
    state = bit.bxor(state, bit.rshift(state, 17))
    state = bit.bxor(state, bit.lshift(state, 5))
    pointer[i] = bit.band(state, 0xff)
  end
end

local function setup()
  local plan = plan_module.build({ family = "qwen3_moe", config = "tiny" }, { bytes = 2 ^ 40, count = 1 })
  local family = plan_module.family("qwen3_moe")
  local opened = {}
  local function anonymous(bytes)
    local memory = assert(shm.anonymous(math.max(bytes, 1)))
    opened[#opened + 1] = memory
    return memory
  end
  -- Every trainer tensor whole, and each rank's shards of it in its own memory.
  local whole, ranks = {}, {}
  for r = 1, WORLD do
    ranks[r] = { shards = {}, memories = {} }
  end
  for index, tensor in ipairs(plan.layout) do
    local memory = anonymous(tensor.bytes)
    fill_random(memory, tensor.bytes, index * 7919 + 1)
    whole[tensor.name] = memory
    local rows = tensor.shape[1]
    local row_bytes = tensor.bytes / rows
    local chunk = math.ceil(rows / WORLD)
    for r = 1, WORLD do
      local first = math.min((r - 1) * chunk, rows)
      local count = math.min(chunk, rows - first)
      local shard = anonymous(count * row_bytes)
      ffi.copy(shard:pointer(), ffi.cast("uint8_t *", memory:pointer()) + first * row_bytes, count * row_bytes)
      local memories = ranks[r].memories
      memories[#memories + 1] = shard
      ranks[r].shards[tensor.name] = { rows = { first, count }, row_bytes = row_bytes, offset = 0,
        source = #memories }
    end
  end
  -- Each worker's resident storage, from the whole canonical tensors.
  local workers = {}
  for w = 1, TP do
    local loader = family.loader_plan(plan.config, TP, w - 1)
    local resident = anonymous(loader.bytes)
    for _, tensor in ipairs(plan.canonical) do
      local copies = loader.copies[tensor.name]
      if copies then
        local batch = copy_module.batch(#copies)
        for _, c in ipairs(copies) do
          batch:add(c.dst, c.src, c.rows, c.width, c.dst_pitch, c.src_pitch)
        end
        local source = ffi.cast("uint8_t *", whole[tensor.source]:pointer()) + tensor.source_offset
        assert(copy_module.run(resident, { pointer = source, size = tensor.bytes }, batch, tensor.name))
      end
    end
    workers[w] = { loader = loader, resident = resident }
  end
  local function close()
    for _, memory in ipairs(opened) do
      memory:close()
    end
  end
  return plan, ranks, workers, close
end

local function check(plan, ranks, workers)
  local loaders, by_rank, reported = {}, {}, {}
  for w, worker in ipairs(workers) do
    loaders[w] = worker.loader
    reported[w] = { rank = w - 1, tensors = values.resident(worker.loader, worker.resident) }
  end
  for r, rank in ipairs(ranks) do
    by_rank[r] = {}
    for w, worker in ipairs(workers) do
      by_rank[r][w] = values.trainer(worker.loader, plan, rank.shards, rank.memories)
    end
  end
  return values.check(loaders, by_rank, reported)
end

describe("wsync.plan.values", function()
  it("finds that the ranks' sums add up to every worker's resident tensors", function()
    local plan, ranks, workers, close = setup()
    local ok, result = pcall(check, plan, ranks, workers)
    close()
    assert(ok, result)
    assert.are.equal(TP, result.workers)
    assert.are.equal(#workers[1].loader.tensors + #workers[2].loader.tensors, result.tensors)
  end)

  it("finds one changed element, naming the worker and the tensor", function()
    local plan, ranks, workers, close = setup()
    local target = workers[2].loader.tensors[3]
    local bytes = ffi.cast("uint8_t *", workers[2].resident:pointer())
    bytes[target.offset + 5] = bit.bxor(bytes[target.offset + 5], 1)
    local ok, err = pcall(check, plan, ranks, workers)
    close()
    assert.is_false(ok)
    assert.are.equal("VERIFY_RESIDENT", err.code)
    assert.are.equal(1, err.rank)
    assert.matches("TP worker 1 holds " .. target.name:gsub("%p", "%%%0") .. " with values sum %x+; the trainer "
      .. "ranks' values give %x+", err.message)
  end)

  it("finds two elements of one tensor swapped", function()
    local plan, ranks, workers, close = setup()
    local target = workers[1].loader.tensors[1]
    local elements = ffi.cast("uint16_t *", ffi.cast("uint8_t *", workers[1].resident:pointer()) + target.offset)
    if elements[0] == elements[1] then
      elements[1] = elements[1] + 1 -- (then it is a change, also found)
    end
    elements[0], elements[1] = elements[1], elements[0]
    local ok, err = pcall(check, plan, ranks, workers)
    close()
    assert.is_false(ok)
    assert.matches(target.name, err.message, 1, true)
  end)

  it("names a tensor a rank did not register", function()
    local plan, ranks, workers, close = setup()
    ranks[1].shards["model.norm.weight"] = nil
    local ok, err = pcall(values.trainer, workers[1].loader, plan, ranks[1].shards, ranks[1].memories)
    close()
    assert.is_false(ok)
    assert.are.equal("VALUES_FAILED", err.code)
    assert.matches("the plan's model.norm.weight comes from model.norm.weight, which this rank did not register",
      err.message, 1, true)
  end)
end)
