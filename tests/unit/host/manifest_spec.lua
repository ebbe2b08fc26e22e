-- The manifest: SHA-256 over ordered structural records, through the FFI.
local ffi = require("ffi")
local bit = require("bit")
local C = require("wsync.native.ffi")
local core = require("tests.helpers.core_manifest")
local process = require("tests.helpers.process")

local function copy_records(records)
  local result = {}
  for i, record in ipairs(records) do
    local shape = {}
    for j, value in ipairs(record[3]) do
      shape[j] = value
    end
    result[i] = { record[1], record[2], shape }
  end
  return result
end

local function detail()
  return ffi.string(C.ws_error_detail())
end

-- Asserts that the core's failure detail contains `text` (plain text).
local function assert_detail(text)
  local actual = detail()
  assert(actual:find(text, 1, true), string.format("detail %q lacks %q", actual, text))
end

-- The documented byte encoding (host/manifest.h, version 1), built here
-- independently of the C code.
local function u32(value)
  local bytes = {}
  for i = 1, 4 do
    bytes[i] = value % 256
    value = math.floor(value / 256)
  end
  return string.char(unpack(bytes))
end

local function u64(value)
  local bytes = {}
  for i = 1, 8 do
    bytes[i] = value % 256
    value = math.floor(value / 256)
  end
  return string.char(unpack(bytes))
end

local element_sizes = { bfloat16 = 2, float32 = 4, float64 = 8, float8_e4m3fn = 1, int32 = 4, int64 = 8 }

local function encode(records)
  local parts = { "wsync-manifest-v1\n" }
  for _, record in ipairs(records) do
    local name, dtype, shape = record[1], record[2], record[3]
    local elements = 1
    parts[#parts + 1] = u32(#name) .. name .. u32(#dtype) .. dtype .. u32(#shape)
    for _, dim in ipairs(shape) do
      parts[#parts + 1] = u64(dim)
      elements = elements * dim
    end
    parts[#parts + 1] = u64(elements) .. u64(elements * assert(element_sizes[dtype], dtype))
  end
  parts[#parts + 1] = u64(#records)
  return table.concat(parts)
end

local function sha256sum(bytes)
  local result = process.run({ program = "sha256sum", args = { "-b", "-" }, stdin = bytes })
  assert(result.code == 0, "sha256sum failed: " .. result.stderr)
  return (assert(result.stdout:match("^(%x+)"), result.stdout))
end

describe("manifest digest", function()
  it("is 64 lowercase hex digits and the same for the same records", function()
    local first = core.digest(core.sample)
    local second = core.digest(copy_records(core.sample))
    assert.matches("^" .. string.rep("[0-9a-f]", 64) .. "$", first)
    assert.are.equal(first, second)
  end)

  it("is the same in a separate process", function()
    local here = core.digest(core.sample)
    local result = process.wsync({ "-e",
      'print((require("tests.helpers.core_manifest").digest(require("tests.helpers.core_manifest").sample)))' })
    assert.are.equal(0, result.code, result.stderr)
    assert.are.equal(here .. "\n", result.stdout)
  end)

  it("matches sha256sum over the byte encoding documented in host/manifest.h", function()
    local encoded = encode(core.sample)
    local digest, count, bytes = core.digest(core.sample)
    assert.are.equal(sha256sum(encoded), digest)
    assert.are.equal(#core.sample, count)
    assert.are.equal(1024 * 64 * 2 + 128 * 64 * 2 + 8 * 64 * 4 + 64 * 32 + 8 + 0 + 6 * 8, bytes)
  end)

  it("of no records matches sha256sum over the preamble and a zero count", function()
    assert.are.equal(sha256sum("wsync-manifest-v1\n" .. u64(0)), (core.digest({})))
  end)

  it("changes when one name, dtype or shape dimension changes", function()
    local base = core.digest(core.sample)
    local seen = { [base] = "base" }
    local function expect_new(records, what)
      local digest = core.digest(records)
      assert.is_nil(seen[digest], what .. " gives the digest of " .. tostring(seen[digest]))
      seen[digest] = what
    end
    for index, record in ipairs(core.sample) do
      local renamed = copy_records(core.sample)
      renamed[index][1] = record[1] .. "x"
      expect_new(renamed, "rename " .. index)

      local retyped = copy_records(core.sample)
      retyped[index][2] = record[2] == "float16" and "bfloat16" or "float16"
      expect_new(retyped, "retype " .. index)

      for dim = 1, #record[3] do
        local reshaped = copy_records(core.sample)
        reshaped[index][3][dim] = record[3][dim] + 1
        expect_new(reshaped, "reshape " .. index .. "." .. dim)
      end

      local extra_dim = copy_records(core.sample)
      table.insert(extra_dim[index][3], 1)
      expect_new(extra_dim, "extra unit dimension " .. index)
    end
    local dropped = copy_records(core.sample)
    table.remove(dropped)
    expect_new(dropped, "drop the last record")
  end)

  it("changes when records are reordered", function()
    local reordered = copy_records(core.sample)
    reordered[1], reordered[2] = reordered[2], reordered[1]
    assert.are_not.equal(core.digest(core.sample), (core.digest(reordered)))
  end)

  it("keeps name and dtype bytes apart (length prefixes)", function()
    local a = core.digest({ { "ab", "int8", { 1 } }, { "c", "int8", { 1 } } })
    local b = core.digest({ { "a", "int8", { 1 } }, { "bc", "int8", { 1 } } })
    assert.are_not.equal(a, b)
  end)
end)

describe("manifest lifetime", function()
  local manifest
  before_each(function()
    manifest = core.new()
  end)
  after_each(function()
    C.ws_manifest_free(manifest)
    manifest = nil
  end)

  it("writes the same digest when finished twice", function()
    assert.are.equal(0, core.add(manifest, { "w", "bfloat16", { 2, 3 } }))
    local status1, first = core.finish(manifest)
    local status2, second = core.finish(manifest)
    assert.are.equal(0, status1)
    assert.are.equal(0, status2)
    assert.are.equal(first, second)
    assert.are.equal(first, (core.digest({ { "w", "bfloat16", { 2, 3 } } })))
  end)

  it("refuses a record after finish with WS_ESTATE and keeps its digest", function()
    local _, before = core.finish(manifest)
    assert.are.equal(C.WS_ESTATE, core.add(manifest, { "late", "bfloat16", { 1 } }))
    assert_detail("after finish")
    assert.are.equal(0, tonumber(C.ws_manifest_count(manifest)))
    local _, after = core.finish(manifest)
    assert.are.equal(before, after)
  end)

  it("counts records and bytes; a scalar has one element", function()
    assert.are.equal(0, core.add(manifest, { "scalar", "float32", {} }))
    assert.are.equal(1, tonumber(C.ws_manifest_count(manifest)))
    assert.are.equal(4, tonumber(C.ws_manifest_bytes(manifest)))
    assert.are.equal(0, core.add(manifest, { "zero", "float32", { 5, 0 } }))
    assert.are.equal(4, tonumber(C.ws_manifest_bytes(manifest)))
    assert.are.equal(0, core.add(manifest, { "m", "int64", { 3, 5 } }))
    assert.are.equal(3, tonumber(C.ws_manifest_count(manifest)))
    assert.are.equal(4 + 3 * 5 * 8, tonumber(C.ws_manifest_bytes(manifest)))
  end)

  it("accepts the largest dimension count and a NULL shape for a scalar", function()
    assert.are.equal(0, core.add(manifest, { "eight", "int8", { 1, 2, 1, 2, 1, 2, 1, 2 } }))
    assert.are.equal(16, tonumber(C.ws_manifest_bytes(manifest)))
    assert.are.equal(0, C.ws_manifest_add(manifest, "s", 1, C.WS_DTYPE_INT16, nil, 0))
    assert.are.equal(18, tonumber(C.ws_manifest_bytes(manifest)))
  end)

  it("frees NULL", function()
    assert.has_no.errors(function()
      C.ws_manifest_free(nil)
    end)
  end)
end)

describe("manifest refusals", function()
  local manifest
  before_each(function()
    manifest = core.new()
    assert.are.equal(0, core.add(manifest, { "first", "bfloat16", { 4 } }))
  end)
  after_each(function()
    C.ws_manifest_free(manifest)
    manifest = nil
  end)

  -- A refused record leaves the manifest as it was.
  local function assert_unchanged()
    assert.are.equal(1, tonumber(C.ws_manifest_count(manifest)))
    assert.are.equal(8, tonumber(C.ws_manifest_bytes(manifest)))
    local status, digest = core.finish(manifest)
    assert.are.equal(0, status)
    assert.are.equal(core.digest({ { "first", "bfloat16", { 4 } } }), digest)
  end

  it("refuses more than WS_MANIFEST_MAX_DIMS or negative dimension counts", function()
    local shape = {}
    for i = 1, tonumber(C.WS_MANIFEST_MAX_DIMS) + 1 do
      shape[i] = 1
    end
    assert.are.equal(C.WS_EINVAL, core.add(manifest, { "nine", "int8", shape }))
    assert_detail("'nine' has 9 dimensions")
    assert.are.equal(C.WS_EINVAL, core.add(manifest, { "minus", "int8", {}, -1 }))
    assert_detail("'minus' has -1 dimensions")
    assert_unchanged()
  end)

  it("refuses a negative dimension, naming the record and dimension", function()
    assert.are.equal(C.WS_EINVAL, core.add(manifest, { "neg", "float32", { 4, -3 } }))
    assert_detail("'neg' dimension 1 is -3")
    assert_unchanged()
  end)

  it("refuses an unknown dtype", function()
    for _, dtype in ipairs({ tonumber(C.WS_DTYPE_COUNT), 99, -1 }) do
      assert.are.equal(C.WS_EINVAL, core.add(manifest, { "odd", dtype, { 1 } }))
      assert_detail("unknown dtype " .. dtype .. " for 'odd'")
    end
    assert_unchanged()
  end)

  it("refuses an empty name", function()
    assert.are.equal(C.WS_EINVAL, core.add(manifest, { "", "int8", { 1 } }))
    assert_detail("name length 0")
    assert_unchanged()
  end)

  it("answers WS_EOVERFLOW when the element count overflows 64 bits", function()
    local big = bit.lshift(1LL, 32)
    assert.are.equal(C.WS_EOVERFLOW, core.add(manifest, { "huge", "int8", { big, big } }))
    assert_detail("'huge' element count overflows")
    assert_unchanged()
  end)

  it("answers WS_EOVERFLOW when the byte count overflows 64 bits", function()
    assert.are.equal(C.WS_EOVERFLOW, core.add(manifest, { "wide", "float32", { bit.lshift(1LL, 62) } }))
    assert_detail("'wide' byte count overflows")
    assert_unchanged()
  end)

  it("answers WS_EOVERFLOW when the manifest's total bytes overflow", function()
    local half = bit.lshift(1LL, 62) -- 2^63 bytes in bfloat16
    assert.are.equal(0, core.add(manifest, { "half1", "bfloat16", { half - 4 } }))
    assert.are.equal(C.WS_EOVERFLOW, core.add(manifest, { "half2", "bfloat16", { half } }))
    assert_detail("'half2' byte count overflows")
    assert.are.equal(2, tonumber(C.ws_manifest_count(manifest)))
  end)
end)

describe("manifest at model scale", function()
  it("hashes 40,000 records in one stream", function()
    local manifest = core.new()
    local shape = ffi.new("int64_t[2]", 768, 2048)
    local names = {}
    for i = 1, 40000 do
      names[i] = string.format("model.layers.%d.mlp.experts.%d.gate_proj.weight", math.floor(i / 128), i % 128)
    end
    local started = os.clock()
    for i = 1, 40000 do
      local status = C.ws_manifest_add(manifest, names[i], #names[i], C.WS_DTYPE_BFLOAT16, shape, 2)
      if status ~= 0 then
        C.ws_manifest_free(manifest)
        error("record " .. i .. ": " .. detail())
      end
    end
    local status, digest = core.finish(manifest)
    local seconds = os.clock() - started
    local count = tonumber(C.ws_manifest_count(manifest))
    local bytes = tonumber(C.ws_manifest_bytes(manifest))
    C.ws_manifest_free(manifest)
    io.stderr:write(string.format("\n[manifest: 40,000 records hashed in %.1f ms of CPU]\n", seconds * 1000))
    assert.are.equal(0, status)
    assert.matches("^%x+$", digest)
    assert.are.equal(40000, count)
    assert.are.equal(40000 * 768 * 2048 * 2, bytes)
  end)
end)
