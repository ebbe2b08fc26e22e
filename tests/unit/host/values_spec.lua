-- Composable value sums (host/values.c), through the FFI: any split of a
-- tensor's elements into ops sums to the whole, a partial range reads only
-- its bytes (negative bias included), and every malformed op is refused before
-- anything is summed, naming the op.
local ffi = require("ffi")
local C = require("wsync.native.ffi")

local function detail()
  return ffi.string(C.ws_error_detail())
end

local SEED = C.ws_values_seed("t", 1)

local function op(fields)
  local out = ffi.new("ws_values_op")
  out.bias, out.first, out.rows, out.width = fields.bias or 0, fields.first or 0, fields.rows or 1, fields.width
  out.pitch, out.lo, out.hi = fields.pitch or fields.width, fields.lo or 0, fields.hi or 2 ^ 40
  out.index_first, out.index_pitch = fields.index_first or 0, fields.index_pitch or 0
  out.seed, out.slot = SEED, fields.slot or 0
  return out
end

local function sum(memory, size, element, list, slots)
  local ops = ffi.new("ws_values_op[?]", #list)
  for i, o in ipairs(list) do
    ops[i - 1] = o
  end
  local sums = ffi.new("uint64_t[?]", slots or 1)
  local status = C.ws_values_sum(memory, size, element, ops, #list, sums, slots or 1)
  return status, sums
end

-- 64 uint16 elements, i * 37 + 1.
local data = ffi.new("uint16_t[64]")
for i = 0, 63 do
  data[i] = i * 37 + 1
end

describe("ws_values_sum", function()
  local whole
  before_each(function()
    local status, sums = sum(data, 128, 2, { op({ width = 128 }) })
    assert.are.equal(0, status, detail())
    whole = sums[0]
  end)

  it("sums a tensor split by rows, by a byte range and into a strided box to the same value", function()
    -- 8 rows of 16 bytes (8 elements), rows 0-2 in one op, 3-7 in another.
    local status, sums = sum(data, 128, 2, {
      op({ first = 0, rows = 3, width = 16, pitch = 16, index_pitch = 8 }),
      op({ first = 48, rows = 5, width = 16, pitch = 16, index_first = 24, index_pitch = 8 }),
    })
    assert.are.equal(0, status, detail())
    assert.are.equal(whole, sums[0])
    -- The same region clipped by two ranks' byte ranges [0, 70) and [70, 128).
    status, sums = sum(data, 128, 2, {
      op({ rows = 8, width = 16, pitch = 16, index_pitch = 8, hi = 70 }),
      op({ rows = 8, width = 16, pitch = 16, index_pitch = 8, lo = 70 }),
    })
    assert.are.equal(0, status, detail())
    assert.are.equal(whole, sums[0])
  end)

  it("reads S-byte x at memory byte bias + x, a negative bias too", function()
    -- The rank holds S-bytes [64, 128) in memory that starts at S-byte 64.
    local _, low = sum(data, 128, 2, { op({ width = 128, hi = 64 }) })
    local status, high = sum(data + 32, 64, 2, { op({ bias = -64, width = 128, lo = 64 }) })
    assert.are.equal(0, status, detail())
    assert.are.equal(whole, low[0] + high[0])
  end)

  it("depends on where each value is", function()
    local swapped = ffi.new("uint16_t[64]")
    ffi.copy(swapped, data, 128)
    swapped[3], swapped[4] = swapped[4], swapped[3]
    local _, sums = sum(swapped, 128, 2, { op({ width = 128 }) })
    assert.are_not.equal(whole, sums[0])
  end)

  it("refuses a malformed op before summing anything, naming it", function()
    local cases = {
      { op({ width = 130 }), "values op 1: bytes [0, 130) lie outside the 128 bytes of memory" },
      { op({ bias = -2, width = 16 }), "values op 1: bytes [-2, 14) lie outside" },
      { op({ width = 3 }), "values op 1: offsets, widths, pitches and bounds must be whole 2-byte elements" },
      { op({ width = 16, slot = 1 }), "values op 1: slot 1 of 1" },
      { op({ rows = 2, width = 16, pitch = 8 }), "values op 1: rows overlap (pitch 8 < width 16)" },
    }
    for _, case in ipairs(cases) do
      local status, sums = sum(data, 128, 2, { op({ width = 2 }), case[1] })
      assert.are.equal(C.WS_EINVAL, status, case[2])
      assert.matches(case[2], detail(), 1, true)
      assert.are.equal(0ULL, sums[0], "nothing summed")
    end
    assert.are.equal(C.WS_EINVAL, (sum(data, 128, 3, { op({ width = 6 }) })))
    assert.matches("element size 3 is not 1, 2, 4 or 8", detail(), 1, true)
  end)
end)
