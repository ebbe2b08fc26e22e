-- The batched copy kernel on a GPU (host/cuda_plan.c, host/cuda_kernels.cu):
-- random descriptor sets (aligned, unaligned, strided, many tiny ops, one
-- huge op, several sources and targets in one launch) against a host
-- reference copy, one launch per plan, in both layouts (per-warp ranges, and
-- tiles the warps take in turn, of 512 B, 8 KiB and 64 KiB), runs of ops
-- copied by CUDA's own copy (bulk), and the checks
-- that make a bad region an error rather than a fault. Without a usable device the whole file is
-- reported as pending, with the reason the core gave.
local ffi = require("ffi")
local support = require("tests.gpu.support")
local cuda = require("wsync._cuda")

local count, reason = support.devices()

local MiB = 1024 * 1024
local SOURCE_BYTES = 48 * MiB
local TARGET_BYTES = 32 * MiB

describe("cuda batched copies", function()
  if count == 0 then
    pending("no CUDA device: " .. reason)
    return
  end

  local stream, sources, targets, host_sources
  setup(function()
    stream = assert(cuda.stream(0))
    sources, targets, host_sources = {}, {}, {}
    for i = 1, 2 do
      sources[i] = assert(cuda.buffer(0, SOURCE_BYTES))
      targets[i] = assert(cuda.buffer(0, TARGET_BYTES))
      host_sources[i] = support.pattern(SOURCE_BYTES, "source " .. i)
      assert(sources[i]:write(0, ffi.string(host_sources[i], SOURCE_BYTES)))
    end
  end)

  teardown(function()
    for i = 1, 2 do
      assert(sources[i]:close())
      assert(targets[i]:close())
    end
    assert(stream:close())
  end)

  -- Regions 1, 2: targets; 3, 4: sources. Fills the targets with 0xaa, runs
  -- the ops as one plan (one launch, `launches` times; `options`:
  -- copy_plan's), and compares both targets with a host copy of the same ops.
  local function check(ops, launches, options)
    local want = {}
    for i = 1, 2 do
      assert(targets[i]:fill(0, TARGET_BYTES, 0xaa, stream))
      want[i] = support.bytes(TARGET_BYTES, 0xaa)
    end
    for _, op in ipairs(ops) do
      local rows = op.rows or 1
      for row = 0, (op.width > 0 and rows or 1) - 1 do
        ffi.copy(want[op.target] + op.target_offset + row * (op.target_pitch or op.width),
          host_sources[op.source - 2] + op.source_offset + row * (op.source_pitch or op.width), op.width)
      end
    end
    local plan = assert(cuda.copy_plan(0, { targets[1], targets[2], sources[1], sources[2] }, ops, options))
    local info = plan:info()
    assert.are.equal(#ops, info.ops)
    assert.are.equal(options and options.tile or 0, info.tile)
    local before = cuda.counters().launches
    for _ = 1, launches or 1 do
      assert(plan:launch(stream))
    end
    assert(stream:synchronize())
    local launched = cuda.counters().launches - before
    assert(plan:close())
    assert.are.equal(info.pieces > 0 and (launches or 1) or 0, launched)
    for i = 1, 2 do
      support.assert_same(ffi.string(want[i], TARGET_BYTES), assert(targets[i]:read(0, TARGET_BYTES)), "target " .. i)
    end
    return info
  end

  -- Random ops placed back to back in the targets (so that none overlaps
  -- another), each with `make(i)` giving rows, width and pitches.
  local function random_ops(n, make)
    local ops, cursor = {}, { 0, 0 }
    for i = 1, n do
      local op = make(i)
      op.rows = op.rows or 1
      op.target_pitch = op.target_pitch or op.width
      op.source_pitch = op.source_pitch or op.width
      op.target = math.random(1, 2)
      op.source = math.random(3, 4)
      local target_span = (op.rows - 1) * op.target_pitch + op.width
      local source_span = (op.rows - 1) * op.source_pitch + op.width
      local at = cursor[op.target] + (op.gap or 0)
      if at + target_span <= TARGET_BYTES then
        op.target_offset = at
        op.source_offset = op.source_align and math.random(0, math.floor((SOURCE_BYTES - source_span) / 16)) * 16
          or math.random(0, SOURCE_BYTES - source_span)
        cursor[op.target] = at + target_span
        op.gap, op.source_align = nil, nil
        ops[#ops + 1] = op
      end
    end
    return ops
  end

  for _, layout in ipairs({ { name = "per-warp ranges" }, { name = "tiles of 512 B", tile = 512 },
    { name = "tiles of 8 KiB", tile = 8192 }, { name = "tiles of 64 KiB", tile = 65536 } }) do
    local options = layout.tile and { tile = layout.tile } or nil
    describe("in " .. layout.name, function()
      it("copies aligned contiguous ops", function()
        math.randomseed(1)
        check(random_ops(300, function()
          return { width = math.random(1, 4096) * 16, gap = math.random(0, 4) * 16, source_align = true }
        end), 1, options)
      end)

      it("copies unaligned contiguous ops, alike and differently misaligned", function()
        math.randomseed(2)
        check(random_ops(500, function()
          return { width = math.random(1, 100000), gap = math.random(0, 15) }
        end), 1, options)
      end)

      it("copies strided ops: TP slices of rows and of columns", function()
        math.randomseed(3)
        check(random_ops(200, function(i)
          local rows = math.random(2, 600)
          if i % 2 == 0 then
            -- a column slice: 16-byte aligned pitches and width
            local width = math.random(1, 64) * 16
            return { rows = rows, width = width, target_pitch = width, source_pitch = width * math.random(2, 4),
              source_align = true }
          end
          local width = math.random(1, 3000)
          return { rows = rows, width = width, target_pitch = width + math.random(0, 40),
            source_pitch = width + math.random(0, 300) }
        end), 1, options)
      end)

      it("copies 10,000 tiny ops in one launch", function()
        math.randomseed(4)
        local info = check(random_ops(10000, function()
          return { width = math.random(1, 64), gap = math.random(0, 3) }
        end), 1, options)
        assert.is_true(info.warps > 1)
      end)

      it("copies one huge op spread over every warp", function()
        local info = check({ { target = 1, source = 3, target_offset = 0, source_offset = 16,
          width = TARGET_BYTES - 16 } }, 1, options)
        if options then
          assert.are.equal(1, info.pieces) -- (the warps take its tiles in turn)
        else
          assert.is_true(info.pieces >= 100, "one huge op makes " .. info.pieces .. " pieces")
        end
      end)

      it("copies a mix of every kind from two sources into two targets, and the same again when launched twice",
        function()
        math.randomseed(5)
        local ops = random_ops(3000, function(i)
          local kind = i % 4
          if kind == 0 then
            return { width = math.random(1, 200000) }
          elseif kind == 1 then
            return { width = math.random(1, 32) }
          elseif kind == 2 then
            return { rows = math.random(2, 100), width = math.random(1, 1000), source_pitch = 1024 }
          end
          return { width = math.random(1, 64) * 16, source_align = true }
        end)
        check(ops, 2, options)
      end)
    end)
  end

  it("copies runs of ops that continue one another with CUDA's own copy (bulk), the rest in the kernel", function()
    math.randomseed(6)
    -- (Expert-like runs: ops back to back on both sides, 1-3 MiB each, with
    -- small and strided ops between the runs.)
    local ops, to, from = {}, { 0, 0 }, 0
    for run = 1, 6 do
      local target = 1 + run % 2
      for _ = 1, 3 do
        local width = math.random(1, 2) * MiB + math.random(0, 15) * 16
        ops[#ops + 1] = { target = target, source = 3, target_offset = to[target], source_offset = from,
          width = width }
        to[target], from = to[target] + width, from + width
      end
      ops[#ops + 1] = { target = target, source = 4, target_offset = to[target] + 64, source_offset = run * 40000,
        rows = 8, width = 1000, target_pitch = 1024, source_pitch = 3000 }
      to[target], from = to[target] + 64 + 8 * 1024, from + 4096
    end
    local info = check(ops, 2, { tile = 65536, bulk = 2 * MiB })
    assert.are.equal(6, info.bulk)
    assert.is_true(info.bulk_bytes > 0 and info.bulk_bytes < info.bytes)
    -- (Every op a bulk copy: no kernel launch at all.)
    info = check({ { target = 1, source = 3, target_offset = 0, source_offset = 0, width = 8 * MiB },
      { target = 1, source = 3, target_offset = 8 * MiB, source_offset = 8 * MiB, width = 8 * MiB } }, 1,
      { bulk = MiB })
    assert.are.same({ 1, 16 * MiB, 0 }, { info.bulk, info.bulk_bytes, info.pieces })
  end)

  it("skips a plan of empty ops without launching", function()
    check({ { target = 1, source = 3, target_offset = 0, source_offset = 0, rows = 5, width = 0 } })
  end)

  it("refuses a region that is host memory or runs past its allocation", function()
    local host = support.bytes(4096)
    local pointer = tonumber(ffi.cast("uintptr_t", host))
    local plan, message, code = cuda.copy_plan(0, { { pointer = pointer, size = 4096, device = 0 }, sources[1] },
      { { target = 1, source = 2, width = 64 } })
    assert.is_nil(plan)
    assert.are.equal("EINVAL", code)
    assert.matches("is not device memory", message, 1, true)
    local region = sources[1]:region()
    region.size = region.size + 4096
    plan, message, code = cuda.copy_plan(0, { targets[1], region }, { { target = 1, source = 2, width = 64,
      source_offset = SOURCE_BYTES } })
    assert.is_nil(plan)
    assert.are.equal("EINVAL", code)
    assert.matches("past the end of its allocation", message, 1, true)
  end)

  it("refuses a region said to be on another device than the plan", function()
    local region = targets[1]:region()
    region.device = 1
    local plan, message, code = cuda.copy_plan(0, { region, sources[1] }, { { target = 1, source = 2, width = 64 } })
    assert.is_nil(plan)
    assert.are.equal("EINVAL", code)
    assert.matches("region 0 is on device 1, not device 0", message, 1, true)
  end)

  it("copies with cudaMemcpyAsync too (the copy engine's floor)", function()
    assert(targets[1]:fill(0, MiB, 0, stream))
    assert(cuda.memcpy(targets[1], 4096, sources[1], 100, 65536, stream))
    assert(stream:synchronize())
    support.assert_same(ffi.string(host_sources[1] + 100, 65536), assert(targets[1]:read(4096, 65536)), "memcpy")
  end)
end)
