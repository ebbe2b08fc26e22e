-- NCCL on GPUs (host/nccl_comm.c): a one-rank communicator (blocking and
-- nonblocking) runs the fill group and the all-gather; the fill's checks
-- refuse bad broadcasts before anything is queued; and, with two or more
-- GPUs, one process per GPU fills every rank's packed buffer from uneven
-- dim-0 shards, checked against the synthetic values of the whole tensors.
-- Without a usable device (or NCCL) the file is pending.
local ffi = require("ffi")
local uv = require("luv")
local support = require("tests.gpu.support")
local process = require("tests.helpers.process")
local cuda = require("wsync._cuda")
local nccl = require("wsync._nccl")

local count, reason = support.devices()
local loaded, why = false, "no device to use it with"
if count > 0 then
  loaded, why = nccl.load()
end

local MiB = 1024 * 1024

-- Polls a nonblocking communicator until its last operation is done.
local function wait_ready(comm)
  for _ = 1, 3000 do
    local ready, message = comm:ready()
    if ready == nil then
      error(message, 2)
    elseif ready then
      return
    end
    uv.sleep(10)
  end
  error("the communicator was not ready within 30 s")
end

describe("nccl with one rank", function()
  if count == 0 then
    pending("no CUDA device: " .. reason)
    return
  end
  if not loaded then
    pending("NCCL does not load: " .. tostring(why))
    return
  end

  local stream, source, target, host
  setup(function()
    stream = assert(cuda.stream(0))
    source = assert(cuda.buffer(0, 8 * MiB))
    target = assert(cuda.buffer(0, 8 * MiB))
    host = support.pattern(8 * MiB, "shard")
    assert(source:write(0, ffi.string(host, 8 * MiB)))
  end)
  teardown(function()
    assert(source:close())
    assert(target:close())
    assert(stream:close())
  end)

  local broadcasts = {
    { root = 0, target_offset = 4096, bytes = MiB, source = 1, source_offset = 0 },
    { root = 0, target_offset = 2 * MiB + 3, bytes = 1000, source = 1, source_offset = 77 },
    { root = 0, target_offset = 3 * MiB, bytes = 0, source = 1 },
  }

  local function check_filled()
    local want = support.bytes(8 * MiB, 0)
    for _, op in ipairs(broadcasts) do
      ffi.copy(want + op.target_offset, host + (op.source_offset or 0), op.bytes)
    end
    support.assert_same(ffi.string(want, 8 * MiB), assert(target:read(0, 8 * MiB)), "filled buffer")
  end

  it("fills a packed buffer from broadcasts, all-gathers, and is destroyed", function()
    local comm = assert(nccl.init(0, 1, 0, assert(nccl.unique_id())))
    assert.are.equal(0, comm:rank())
    assert.are.equal(1, comm:world())
    assert.are.equal(0, comm:device())
    assert(target:fill(0, 8 * MiB, 0, stream))
    assert(comm:fill(stream, target, { source }, broadcasts))
    assert(stream:synchronize())
    check_filled()
    assert(comm:all_gather(stream, target, 5 * MiB, source, 64, MiB))
    assert(stream:synchronize())
    support.assert_same(ffi.string(host + 64, MiB), assert(target:read(5 * MiB, MiB)), "all-gathered block")
    assert.is_true(comm:destroy())
    assert.are.equal("wsync.nccl.comm (closed)", tostring(comm))
  end)

  it("joins without blocking, fills once ready, and aborts", function()
    local comm = assert(nccl.init(0, 1, 0, assert(nccl.unique_id()), true))
    wait_ready(comm)
    assert(target:fill(0, 8 * MiB, 0, stream))
    assert(comm:fill(stream, target, { source }, broadcasts))
    wait_ready(comm)
    assert(stream:synchronize())
    check_filled()
    assert.is_true(comm:abort())
  end)

  it("refuses a bad broadcast before queuing any", function()
    local comm = assert(nccl.init(0, 1, 0, assert(nccl.unique_id())))
    local ok, message, code = comm:fill(stream, target, { source }, { { root = 1, bytes = 10 } })
    assert.is_nil(ok)
    assert.are.equal("EINVAL", code)
    assert.matches("nccl fill op 0: root 1 of a world of 1", message, 1, true)
    ok, message, code = comm:fill(stream, target, { source }, { broadcasts[1],
      { root = 0, target_offset = 8 * MiB - 5, bytes = 10, source = 1 } })
    assert.is_nil(ok)
    assert.are.equal("EINVAL", code)
    assert.matches("nccl fill op 1: target [8388603, +10) exceeds the 8388608-byte buffer", message, 1, true)
    ok, message, code = comm:fill(stream, target, { source }, { { root = 0, bytes = 10, source = 2 } })
    assert.is_nil(ok)
    assert.are.equal("EINVAL", code)
    assert.matches("nccl fill op 0: source region 1 of 1", message, 1, true)
    ok, message, code = comm:all_gather(stream, target, 0, source, 0, 9 * MiB)
    assert.is_nil(ok)
    assert.are.equal("EINVAL", code)
    assert.matches("nccl all-gather: 1 blocks of 9437184 bytes at 0 exceed the 8388608-byte target", message, 1, true)
    assert(comm:destroy())
  end)
end)

-- One trainer rank of the multi-GPU fill: tensors of `rows` x `elements`
-- bfloat16, sharded on dim 0 as FSDP does (ceil(rows / world) rows a rank,
-- the last ranks fewer or none), its shard generated on its GPU; after the
-- fill, its packed buffer must hold every tensor whole.
local RANK = [[
local cuda = require("wsync._cuda")
local nccl = require("wsync._nccl")
local world, rank, id_hex = ...
world, rank = tonumber(world), tonumber(rank)
local id = id_hex:gsub("%x%x", function(pair) return string.char(tonumber(pair, 16)) end)
local tensors = { { name = "a", rows = 1000, elements = 512 }, { name = "b", rows = 7, elements = 4096 },
  { name = "c", rows = 3, elements = 1000 }, { name = "d", rows = 1, elements = 77 } }
local packed_bytes, shard_bytes, shard_ops, check_ops = 0, 0, 0, {}, {}
for _, t in ipairs(tensors) do
  t.chunk = math.ceil(t.rows / world)
  t.slot = packed_bytes
  packed_bytes = packed_bytes + t.rows * t.elements * 2
  local first = math.min(rank * t.chunk, t.rows)
  local mine = math.max(0, math.min(t.chunk, t.rows - first))
  t.shard_offset = shard_bytes
  if mine > 0 then
    shard_ops[#shard_ops + 1] = { region = 1, name = t.name, offset = shard_bytes, elements = mine * t.elements,
      first = first * t.elements }
  end
  shard_bytes = shard_bytes + mine * t.elements * 2
  check_ops[#check_ops + 1] = { region = 1, name = t.name, offset = t.slot, elements = t.rows * t.elements }
end
local stream = assert(cuda.stream(rank))
local shards = assert(cuda.buffer(rank, math.max(shard_bytes, 2)))
local packed = assert(cuda.buffer(rank, packed_bytes))
local generate = assert(cuda.synth_plan(rank, { shards }, shard_ops))
assert(generate:fill(9, stream))
local broadcasts = {}
for _, t in ipairs(tensors) do
  for root = 0, world - 1 do
    local first = math.min(root * t.chunk, t.rows)
    local rows = math.max(0, math.min(t.chunk, t.rows - first))
    broadcasts[#broadcasts + 1] = { root = root, target_offset = t.slot + first * t.elements * 2,
      bytes = rows * t.elements * 2, source = 1, source_offset = t.shard_offset }
  end
end
local comm = assert(nccl.init(rank, world, rank, id))
assert(comm:fill(stream, packed, { shards }, broadcasts))
local check = assert(cuda.synth_plan(rank, { packed }, check_ops))
assert(check:check(9, stream))
print("mismatches=" .. assert(check:result()).mismatches)
assert(comm:destroy())
for _, object in ipairs({ check, generate, packed, shards, stream }) do
  assert(object:close())
end
]]

describe("nccl across GPUs", function()
  if count < 2 then
    pending("needs two or more GPUs; " .. (count == 0 and ("no CUDA device: " .. reason) or "this machine has one"))
    return
  end
  if not loaded then
    pending("NCCL does not load: " .. tostring(why))
    return
  end

  it("fills every rank's packed buffer from uneven dim-0 shards, one process per GPU", function()
    local id = support.hex(assert(nccl.unique_id()))
    local ranks = {}
    for rank = 0, count - 1 do
      ranks[rank + 1] = process.start(process.wsync_binary(), { "-e", RANK, tostring(count), tostring(rank), id })
    end
    local ok, err = pcall(process.drive, function()
      for _, rank in ipairs(ranks) do
        if not rank.done then
          return false
        end
      end
      return true
    end, 120000, "every rank's fill")
    for _, rank in ipairs(ranks) do
      process.finish(rank)
    end
    assert(ok, err)
    for index, rank in ipairs(ranks) do
      assert.are.equal(0, rank.code, "rank " .. (index - 1) .. ": " .. rank.stderr)
      assert.are.equal("mismatches=0\n", rank.stdout, "rank " .. (index - 1))
    end
  end)
end)
