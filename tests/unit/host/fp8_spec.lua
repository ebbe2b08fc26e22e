-- FP8 quantization of bfloat16 (host/fp8.c), through the FFI: the host's
-- reference of the direct loader's transform step, checked against values
-- worked out by hand from the float8_e4m3fn format (4 exponent bits, bias 7,
-- 3 mantissa bits, no infinities, 0x7f NaN, largest finite 448) and vLLM's
-- per-tensor math (bindings/python/wsync/vllm/FP8.md, section 3.1).
local bit = require("bit")
local ffi = require("ffi")
local C = require("wsync.native.ffi")
local fp8 = require("wsync.native.fp8")

-- The bfloat16 bits of a float32 value that bfloat16 holds exactly.
local function bf16(value)
  local box = ffi.new("float[1]", value)
  return bit.rshift(ffi.cast("uint32_t *", box)[0], 16)
end

local function float_bits(value)
  local box = ffi.new("float[1]", value)
  return tonumber(ffi.cast("uint32_t *", box)[0])
end

-- A bfloat16 array of `values` (bytes: 2 each), as host memory.
local function bf16_memory(values)
  local data = ffi.new("uint16_t[?]", math.max(#values, 1))
  for i, value in ipairs(values) do
    data[i - 1] = bf16(value)
  end
  return { pointer = data, size = 2 * #values, anchor = data }
end

local function bytes_memory(size, fill)
  local data = ffi.new("uint8_t[?]", size)
  ffi.fill(data, size, fill or 0)
  return { pointer = data, size = size, anchor = data }
end

local function bytes_of(memory, from, count)
  local out = {}
  for i = 0, count - 1 do
    out[i + 1] = memory.anchor[from + i]
  end
  return out
end

local function scale_at(memory, offset)
  return ffi.cast("float *", memory.anchor + offset)[0]
end

describe("float8_e4m3fn conversion", function()
  it("rounds to nearest, ties to even, in normal and subnormal range", function()
    local cases = {
      { 0, 0x00 }, { -0.0, 0x80 }, { 1, 0x38 }, { -1, 0xb8 },
      { 1.0625, 0x38 },      -- halfway between 1 (mantissa 0) and 1.125: to the even 1
      { 1.1875, 0x3a },      -- halfway between 1.125 and 1.25 (mantissa 2): up
      { 0.1, 0x1d },         -- 1.6 x 2^-4: mantissa 4.8 rounds to 5
      { 240, 0x77 }, { 256, 0x78 }, { 416, 0x7d },
      { 2 ^ -6, 0x08 },      -- the smallest normal
      { 2 ^ -9, 0x01 },      -- the smallest subnormal
      { 2 ^ -10, 0x00 },     -- half of it: a tie, to the even 0
      { 3 * 2 ^ -10, 0x02 }, -- 1.5 subnormal steps: to the even 2
      { 7 * 2 ^ -9, 0x07 },
      { 7.5 * 2 ^ -9, 0x08 }, -- a tie between the largest subnormal and the smallest normal
      { -5 * 2 ^ -9, 0x85 },
    }
    for _, case in ipairs(cases) do
      assert.are.equal(case[2], fp8.from_float(case[1]), tostring(case[1]))
    end
  end)

  it("saturates at +-448, infinities too, and keeps NaN", function()
    assert.are.equal(0x7e, fp8.from_float(448))
    assert.are.equal(0xfe, fp8.from_float(-448))
    assert.are.equal(0x7e, fp8.from_float(432)) -- halfway between 416 and 448: to the even 448
    assert.are.equal(0x7e, fp8.from_float(447))
    assert.are.equal(0x7e, fp8.from_float(480)) -- past the largest finite: saturated
    assert.are.equal(0x7e, fp8.from_float(1e30))
    assert.are.equal(0x7e, fp8.from_float(math.huge))
    assert.are.equal(0xfe, fp8.from_float(-math.huge))
    assert.are.equal(0x7f, fp8.from_float(0 / 0))
  end)

  it("decodes every finite code back to the value that encodes to it", function()
    for code = 0, 255 do
      if code % 128 ~= 0x7f then
        assert.are.equal(code, fp8.from_float(fp8.to_float(code)), string.format("0x%02x", code))
      end
    end
    assert.are.equal(448, fp8.to_float(0x7e))
    assert.are.equal(2 ^ -9, fp8.to_float(0x01))
    assert.is_true(fp8.to_float(0x7f) ~= fp8.to_float(0x7f))
  end)
end)

describe("vLLM's per-tensor quantization", function()
  it("scales by amax / 448 in float32", function()
    assert.are.equal(float_bits(4 / 448), float_bits(fp8.scale(4)))
    assert.are.equal(0, fp8.scale(0))
    assert.are.equal(math.huge, fp8.scale(math.huge))
  end)

  it("multiplies by the float32 reciprocal of the scale, clamps, then converts", function()
    local scale = fp8.scale(4) -- its reciprocal is 111.99999 in float32
    assert.are.equal(0x7e, fp8.quantize(4, scale))
    assert.are.equal(0x6e, fp8.quantize(1, scale))  -- 112 = 1.75 x 2^6
    assert.are.equal(0xf6, fp8.quantize(-2, scale)) -- -224
    assert.are.equal(0x66, fp8.quantize(0.5, scale)) -- 56
    assert.are.equal(0x7e, fp8.quantize(500, 1))    -- clamped
    assert.are.equal(0xfe, fp8.quantize(-500, 1))
  end)

  it("gives what vLLM's kernel gives for a zero scale, infinities and NaN", function()
    -- Scale 0: the reciprocal is infinite and 0 x inf is NaN, which the clamp
    -- (fminf passes NaN over) turns into +448.
    assert.are.equal(0x7e, fp8.quantize(0, 0))
    assert.are.equal(0x7e, fp8.quantize(-0.0, 0))
    -- An infinite scale (an infinite element): the reciprocal is 0.
    assert.are.equal(0x00, fp8.quantize(3, math.huge))
    assert.are.equal(0x80, fp8.quantize(-3, math.huge))
    assert.are.equal(0x7e, fp8.quantize(math.huge, math.huge))
    assert.are.equal(0x7e, fp8.quantize(0 / 0, 1))
  end)
end)

describe("a transform (ws_fp8_run)", function()
  it("scales each group over all its pieces and quantizes them in place", function()
    -- Group 0: a fused qkv of three pieces from one source (q 2 rows, k and v
    -- one row each) into one target of 4 rows x 2; group 1: one strided
    -- piece (columns 1..2 of 2 rows of 4). Scales after the weights.
    local source = bf16_memory({ 1, -2, 0.5, 4, -0.5, 1, 0.25, 0.25, -- q (4 elements, 2 rows), k, v
      0, 3, -6, 0, 0, 1.5, 12, 0 })                                     -- group 1's 2 x 4 rows
    local target = bytes_memory(8 + 2 + 2 + 8, 0xcc)
    local transform = fp8.transform()
    local qkv = transform:add_group(0, 12)
    local rows = transform:add_group(0, 16)
    transform:add({ group = qkv, target_offset = 0, source_offset = 0, rows = 2, columns = 2 })
    transform:add({ group = qkv, target_offset = 4, source_offset = 8, rows = 1, columns = 2 })
    transform:add({ group = qkv, target_offset = 6, source_offset = 12, rows = 1, columns = 2 })
    transform:add({ group = rows, target_offset = 8, source_offset = 16 + 2, rows = 2, columns = 2, target_pitch = 2,
      source_pitch = 8 })
    assert.are.equal(8 + 4 + 8, fp8.run(target, source, transform, "spec"))
    assert.are.same({ 0x6e, 0xf6, 0x66, 0x7e, 0xe6, 0x6e, 0x5e, 0x5e }, bytes_of(target, 0, 8))
    -- group 1: amax 12, so 12 -> 448, 3 -> 112, -6 -> -224, 1.5 -> 56
    assert.are.same({ 0x6e, 0xf6, 0x66, 0x7e }, bytes_of(target, 8, 4))
    assert.are.equal(float_bits(4 / 448), float_bits(scale_at(target, 12)))
    assert.are.equal(float_bits(12 / 448), float_bits(scale_at(target, 16)))
  end)

  it("gives an all-zero group scale 0 and 0x7e elements, and passes NaN over in the amax", function()
    local source = bf16_memory({ 0, -0.0, 0, 0, 1, 0 / 0, 2, math.huge, 1 })
    local target = bytes_memory(9 + 12, 0xcc)
    local transform = fp8.transform()
    local zero, nan, inf = transform:add_group(0, 9), transform:add_group(0, 13), transform:add_group(0, 17)
    transform:add({ group = zero, target_offset = 0, source_offset = 0, rows = 1, columns = 4 })
    transform:add({ group = nan, target_offset = 4, source_offset = 8, rows = 1, columns = 3 })
    transform:add({ group = inf, target_offset = 7, source_offset = 14, rows = 1, columns = 2 })
    assert.is_truthy(fp8.run(target, source, transform))
    assert.are.same({ 0x7e, 0x7e, 0x7e, 0x7e }, bytes_of(target, 0, 4))
    assert.are.equal(0, float_bits(scale_at(target, 9)))
    -- amax 2 (the NaN passed over): 1 -> 224, NaN -> +448, 2 -> 448
    assert.are.same({ 0x76, 0x7e, 0x7e }, bytes_of(target, 4, 3))
    assert.are.equal(float_bits(2 / 448), float_bits(scale_at(target, 13)))
    -- an infinite element: scale inf, its reciprocal 0; inf x 0 is NaN -> +448
    assert.are.same({ 0x7e, 0x00 }, bytes_of(target, 7, 2))
    assert.are.equal(float_bits(math.huge), float_bits(scale_at(target, 17)))
  end)

  it("reads several sources into several targets (a scale beside its weight)", function()
    local first, second = bf16_memory({ 1, 2 }), bf16_memory({ -4, 8 })
    local weight, scale = bytes_memory(4), bytes_memory(4)
    local transform = fp8.transform()
    local group = transform:add_group(1, 0)
    transform:add({ group = group, target = 0, source = 0, target_offset = 0, source_offset = 0, rows = 1,
      columns = 2 })
    transform:add({ group = group, target = 0, source = 1, target_offset = 2, source_offset = 0, rows = 1,
      columns = 2 })
    assert.is_truthy(fp8.run({ weight, scale }, { first, second }, transform))
    assert.are.same({ 0x66, 0x6e, 0xf6, 0x7e }, bytes_of(weight, 0, 4)) -- 56, 112, -224, 448
    assert.are.equal(float_bits(8 / 448), float_bits(scale_at(scale, 0)))
  end)

  it("refuses an op or a group out of range, or a group with no op, writing nothing", function()
    local source = bf16_memory({ 1, 2, 3, 4 })
    local target = bytes_memory(8, 0xcc)
    local function refused(build, pattern)
      local transform = fp8.transform()
      build(transform)
      local ok, message, code = fp8.run(target, source, transform, "spec")
      assert.is_nil(ok)
      assert.are.equal("EINVAL", code)
      assert.matches(pattern, message)
      assert.are.same({ 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc, 0xcc }, bytes_of(target, 0, 8))
    end
    refused(function(t)
      t:add({ group = t:add_group(0, 4), target_offset = 0, source_offset = 2, rows = 1, columns = 4 })
    end, "^spec: fp8 op 0: 1 rows x 4 elements from byte 2")
    refused(function(t)
      t:add({ group = t:add_group(0, 4), target_offset = 6, source_offset = 0, rows = 1, columns = 4 })
    end, "fp8 op 0:.*exceed them")
    refused(function(t)
      t:add({ group = t:add_group(0, 6), target_offset = 0, source_offset = 0, rows = 1, columns = 4 })
    end, "fp8 group 0: its float32 scale at byte 6 exceeds target 0 %(8 bytes%)")
    refused(function(t)
      t:add_group(0, 4)
      t:add({ group = 1, target_offset = 0, source_offset = 0, rows = 1, columns = 4 })
    end, "fp8 op 0: group 1, target 0, source 0 of 1, 1, 1")
    refused(function(t)
      t:add({ group = t:add_group(0, 4), target_offset = 0, source_offset = 0, rows = 1, columns = 2 })
      t:add_group(0, 4)
    end, "fp8 group 1 has no op")
    refused(function(t)
      t:add({ group = t:add_group(0, 4), target_offset = 0, source_offset = 0, rows = 2, columns = 2,
        target_pitch = 1 })
    end, "fp8 op 0:")
  end)

  it("grows past its first capacity", function()
    local count = 40
    local values = {}
    for i = 1, count do
      values[i] = i % 2 == 0 and i or -i
    end
    local source = bf16_memory(values)
    local target = bytes_memory(count + 4 * count)
    local transform = fp8.transform(1, 1)
    for i = 0, count - 1 do
      transform:add({ group = transform:add_group(0, count + 4 * i), target_offset = i, source_offset = 2 * i,
        rows = 1, columns = 1 })
    end
    assert.are.equal(count + 4 * count, fp8.run(target, source, transform))
    for i = 0, count - 1 do
      assert.are.equal(i % 2 == 1 and 0x7e or 0xfe, target.anchor[i]) -- each its own amax: +-448
    end
    assert.are.equal(count, #transform:tables().groups)
    assert.is_true(C.ws_fp8_scale(448) == 1)
  end)
end)
