-- Dtype names and element sizes.
local ffi = require("ffi")
local C = require("wsync.native.ffi")

-- Sizes as torch defines them, written out here independently of the core.
local expected_sizes = {
  bfloat16 = 2, float16 = 2, float32 = 4, float64 = 8, float8_e4m3fn = 1,
  float8_e5m2 = 1, int8 = 1, uint8 = 1, int16 = 2, int32 = 4, int64 = 8, bool = 1,
}

local function lookup(name, length)
  return C.ws_dtype_from_name(name, length or #name)
end

describe("dtype table", function()
  it("covers every dtype the core enumerates, each with a name and size", function()
    local seen = 0
    for index = 0, tonumber(C.WS_DTYPE_COUNT) - 1 do
      local name_pointer = C.ws_dtype_name(index)
      assert.is_false(name_pointer == nil, "dtype " .. index .. " has no name")
      local name = ffi.string(name_pointer)
      assert.is_number(expected_sizes[name], "unexpected dtype " .. name)
      assert.are.equal(expected_sizes[name], tonumber(C.ws_dtype_size(index)))
      assert.are.equal(index, tonumber(lookup(name)))
      seen = seen + 1
    end
    local total = 0
    for _ in pairs(expected_sizes) do
      total = total + 1
    end
    assert.are.equal(total, seen)
  end)

  it("maps names to the enum values that ffi.cdef declares", function()
    assert.are.equal(tonumber(C.WS_DTYPE_BFLOAT16), tonumber(lookup("bfloat16")))
    assert.are.equal(tonumber(C.WS_DTYPE_FLOAT8_E5M2), tonumber(lookup("float8_e5m2")))
    assert.are.equal(tonumber(C.WS_DTYPE_BOOL), tonumber(lookup("bool")))
    assert.are.equal(2, tonumber(C.ws_dtype_size(C.WS_DTYPE_BFLOAT16)))
    assert.are.equal(8, tonumber(C.ws_dtype_size(C.WS_DTYPE_INT64)))
  end)

  it("answers WS_DTYPE_COUNT for unknown names", function()
    local count = tonumber(C.WS_DTYPE_COUNT)
    for _, name in ipairs({ "", "bf16", "BFLOAT16", "bfloat", "bfloat160", "float", "torch.bfloat16" }) do
      assert.are.equal(count, tonumber(lookup(name)), name)
    end
  end)

  it("reads exactly `length` bytes of the name", function()
    assert.are.equal(tonumber(C.WS_DTYPE_FLOAT16), tonumber(lookup("float16 and more", 7)))
    assert.are.equal(tonumber(C.WS_DTYPE_COUNT), tonumber(lookup("float16", 6)))
  end)

  it("answers NULL and 0 out of range", function()
    for _, index in ipairs({ -1, tonumber(C.WS_DTYPE_COUNT), 1000 }) do
      assert.is_true(C.ws_dtype_name(index) == nil)
      assert.are.equal(0, tonumber(C.ws_dtype_size(index)))
    end
  end)
end)
