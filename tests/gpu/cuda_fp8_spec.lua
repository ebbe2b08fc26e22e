-- The FP8 transform on a GPU (host/cuda_plan.c's FP8 plans, the FP8 kernels
-- of host/cuda_kernels.cu) against the host's reference (host/fp8.c), bitwise:
-- a fused qkv of three pieces under one scale, experts under one scale each
-- (gate and up together, like w13_weight), strided pieces (an o_proj column
-- slice) taken element by element, pieces long enough to be cut within and
-- across rows, and groups that are all zero or hold NaN, infinities,
-- subnormal results and +-448. Without a usable device the whole file is
-- reported as pending, with the reason the core gave.
local bit = require("bit")
local ffi = require("ffi")
local support = require("tests.gpu.support")
local cuda = require("wsync._cuda")
local fp8 = require("wsync.native.fp8")

local count, reason = support.devices()

local MiB = 1024 * 1024
local SOURCE_BYTES = 16 * MiB
local TARGET_BYTES = 8 * MiB
local SCALE_BYTES = 64 * 1024

describe("cuda FP8 transform", function()
  if count == 0 then
    pending("no CUDA device: " .. reason)
    return
  end

  local stream, source, target, scales, host_source
  setup(function()
    stream = assert(cuda.stream(0))
    source = assert(cuda.buffer(0, SOURCE_BYTES))
    target = assert(cuda.buffer(0, TARGET_BYTES))
    scales = assert(cuda.buffer(0, SCALE_BYTES))
    -- bfloat16 of both signs, magnitudes 2^-40 to 2^23 (quantized, most
    -- land in range; some groups reach subnormal float8).
    host_source = ffi.cast("uint16_t *", support.bytes(SOURCE_BYTES, 0))
    require("tests.helpers.bfloat16").fill(host_source, SOURCE_BYTES / 2, 0x2545f491, 87, 64)
    assert(source:write(0, ffi.string(host_source, SOURCE_BYTES)))
  end)

  teardown(function()
    assert(source:close())
    assert(target:close())
    assert(scales:close())
    assert(stream:close())
  end)

  -- Writes bfloat16 `values` (Lua numbers bfloat16 holds exactly) at element
  -- `first` of the source, on the host and the device.
  local function put(first, values)
    local bits = ffi.new("uint16_t[?]", #values)
    for i, value in ipairs(values) do
      local box = ffi.new("float[1]", value)
      bits[i - 1] = bit.rshift(ffi.cast("uint32_t *", box)[0], 16)
      host_source[first + i - 1] = bits[i - 1]
    end
    assert(source:write(2 * first, ffi.string(bits, 2 * #values)))
  end

  -- Runs `groups` ({scale_offset}: in the scale region) and `ops` ({group
  -- (from 1), target_offset, source_offset, rows, columns, pitches}: the
  -- target and source regions) on the device as one FP8 plan, and on the
  -- host with the reference; both targets start as 0xaa. Compares them
  -- bitwise and returns the plan's info.
  local function check(groups, ops)
    assert(target:fill(0, TARGET_BYTES, 0xaa, stream))
    assert(scales:fill(0, SCALE_BYTES, 0xaa, stream))
    local host_target, host_scales = support.bytes(TARGET_BYTES, 0xaa), support.bytes(SCALE_BYTES, 0xaa)
    local transform = fp8.transform(#ops, #groups)
    local device_groups, device_ops = {}, {}
    for index, group in ipairs(groups) do
      transform:add_group(1, group.scale_offset)
      device_groups[index] = { target = 2, scale_offset = group.scale_offset }
    end
    for index, op in ipairs(ops) do
      transform:add({ group = op.group - 1, target = 0, source = 0, target_offset = op.target_offset,
        source_offset = op.source_offset, rows = op.rows or 1, columns = op.columns, target_pitch = op.target_pitch,
        source_pitch = op.source_pitch })
      device_ops[index] = { group = op.group, target = 1, source = 3, target_offset = op.target_offset,
        source_offset = op.source_offset, rows = op.rows, columns = op.columns, target_pitch = op.target_pitch,
        source_pitch = op.source_pitch }
    end
    assert(fp8.run({ { pointer = host_target, size = TARGET_BYTES }, { pointer = host_scales, size = SCALE_BYTES } },
      { pointer = host_source, size = SOURCE_BYTES }, transform, "host reference"))
    local plan = assert(cuda.fp8_plan(0, { target, scales, source }, device_groups, device_ops))
    local info = plan:info()
    assert.are.equal(#ops, info.ops)
    local before = cuda.counters().launches
    assert(plan:launch(stream))
    assert(plan:launch(stream)) -- (a second launch gives the same: the amax start from zero again)
    assert(stream:synchronize())
    assert.are.equal(2, cuda.counters().launches - before)
    assert(plan:close())
    support.assert_same(ffi.string(host_scales, SCALE_BYTES), assert(scales:read(0, SCALE_BYTES)), "scales")
    support.assert_same(ffi.string(host_target, TARGET_BYTES), assert(target:read(0, TARGET_BYTES)), "float8")
    return info
  end

  it("quantizes a fused qkv of three pieces under one scale, 8 elements at a time", function()
    local H = 2048
    check({ { scale_offset = 0 } }, {
      { group = 1, target_offset = 0, source_offset = 0, rows = 1, columns = 512 * H },          -- q
      { group = 1, target_offset = 512 * H, source_offset = 4 * MiB, rows = 1, columns = 64 * H }, -- k
      { group = 1, target_offset = 576 * H, source_offset = 6 * MiB, rows = 1, columns = 64 * H }, -- v
    })
  end)

  it("quantizes experts under one scale each, gate and up rows together (w13_weight)", function()
    local E, I, H = 16, 96, 256
    local groups, ops = {}, {}
    for e = 0, E - 1 do
      groups[e + 1] = { scale_offset = 4 * e }
      local expert = e * 2 * I * H
      ops[#ops + 1] = { group = e + 1, target_offset = expert, source_offset = 2 * (2 * expert), rows = 1,
        columns = I * H }
      ops[#ops + 1] = { group = e + 1, target_offset = expert + I * H, source_offset = 2 * (2 * expert + I * H) + 64,
        rows = 1, columns = I * H }
    end
    local info = check(groups, ops)
    assert.are.equal(2 * E, info.ops)
  end)

  it("takes strided and misaligned pieces element by element (an o_proj column slice, odd widths)", function()
    check({ { scale_offset = 4 }, { scale_offset = 12 } }, {
      -- rows of 500 of 2000 columns (a TP4 slice): pitches not multiples of 16
      { group = 1, target_offset = 3, source_offset = 2 * 250, rows = 300, columns = 500, target_pitch = 500,
        source_pitch = 2 * 2000 },
      -- 8 columns, but the target 8-byte misaligned
      { group = 2, target_offset = 200001, source_offset = 2 * MiB, rows = 64, columns = 8, target_pitch = 8,
        source_pitch = 16 },
      { group = 2, target_offset = 300000, source_offset = 2 * MiB + 2, rows = 1, columns = 777 },
    })
  end)

  it("cuts long rows within a row and short ones across rows, into several pieces", function()
    local info = check({ { scale_offset = 0 }, { scale_offset = 4 } }, {
      { group = 1, target_offset = 0, source_offset = 0, rows = 3, columns = 200000, target_pitch = 200000,
        source_pitch = 2 * 200000 + 32 },
      { group = 2, target_offset = 700000, source_offset = 3 * MiB, rows = 4000, columns = 40, target_pitch = 48,
        source_pitch = 96 },
    })
    assert.is_true(info.pieces > 2 * 3 + 2)
  end)

  it("gives what vLLM's kernel gives for a zero group, NaN, infinities, tiny values and +-448", function()
    local base = 7 * MiB / 2 -- (elements: in the source's last part)
    put(base, { 0, -0.0, 0, 0, 0, 0, 0, 0 })                                       -- all zero: scale 0, 0x7e
    put(base + 8, { 1, 0 / 0, -2, 3, 0 / 0, 0.5, 0.25, -0.125 })                  -- NaN passed over in the amax
    put(base + 16, { 1, math.huge, -3, 2, 0, -math.huge, 5, 7 })                  -- an infinity: scale inf
    put(base + 24, { 448, -448, 2 ^ -9, 2 ^ -100, -2 ^ -100, 300, 2 ^ -20, 1 })  -- subnormal float8 results
    put(base + 32, { 2 ^ -100, -2 ^ -100, 2 ^ -110, 0, 2 ^ -101, 2 ^ -120, 0, 2 ^ -99 }) -- a tiny amax
    -- amax 2^-120: the scale is a subnormal float32 and its reciprocal
    -- overflows to infinity (a device flushing subnormals would give scale 0)
    put(base + 40, { 2 ^ -120, -2 ^ -121, 2 ^ -126, 0, -0.0, 2 ^ -122, 2 ^ -124, -2 ^ -120 })
    local groups, ops = {}, {}
    for g = 0, 5 do
      groups[g + 1] = { scale_offset = 4 * g }
      ops[g + 1] = { group = g + 1, target_offset = 8 * g, source_offset = 2 * (base + 8 * g), rows = 1, columns = 8 }
    end
    check(groups, ops)
    local scale_bits = assert(scales:read(0, 20))
    assert.are.equal(string.rep("\0", 4), scale_bits:sub(1, 4))
    assert.are.equal(string.rep("\126", 8), assert(target:read(0, 8)))
  end)

  it("refuses a misaligned scale or bfloat16 source, and a group with no op, naming them", function()
    local function refusal(groups, ops)
      local plan, message, code = cuda.fp8_plan(0, { target, scales, source }, groups, ops)
      assert.is_nil(plan)
      assert.are.equal("EINVAL", code)
      return message
    end
    assert.matches("fp8 group 0: its float32 scale at byte 2 of region 1 is not 4%-byte aligned",
      refusal({ { target = 2, scale_offset = 2 } }, { { group = 1, target = 1, source = 3, columns = 8 } }))
    assert.matches("fp8 op 0: its bfloat16 source %(byte 1 of region 2",
      refusal({ { target = 2, scale_offset = 0 } }, { { group = 1, target = 1, source = 3, source_offset = 1,
        columns = 8 } }))
    assert.matches("fp8 group 1 has no op", refusal({ { target = 2, scale_offset = 0 }, { target = 2,
      scale_offset = 4 } }, { { group = 1, target = 1, source = 3, columns = 8 } }))
  end)
end)
