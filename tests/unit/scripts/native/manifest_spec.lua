-- wsync.native.manifest: the Lua side of manifests.
local manifest = require("wsync.native.manifest")
local core = require("tests.helpers.core_manifest")

describe("manifest.of", function()
  it("gives the core's digest, count and bytes", function()
    local result = manifest.of(core.sample)
    local digest, count, bytes = core.digest(core.sample)
    assert.are.equal(digest, result.digest)
    assert.are.equal(count, result.count)
    assert.are.equal(bytes, result.bytes)
  end)

  it("accepts named records", function()
    local named = {}
    for i, record in ipairs(core.sample) do
      named[i] = { name = record[1], dtype = record[2], shape = record[3] }
    end
    assert.are.equal(manifest.of(core.sample).digest, manifest.of(named).digest)
  end)

  it("hashes an empty list", function()
    local result = manifest.of({})
    assert.are.equal((core.digest({})), result.digest)
    assert.are.equal(0, result.count)
    assert.are.equal(0, result.bytes)
  end)

  it("names the position and name of a record the core refuses", function()
    local ok, err = pcall(manifest.of, {
      { "good", "int8", { 1 } },
      { "negative", "int8", { 2, -1 } },
    })
    assert.is_false(ok)
    assert.matches("manifest record 2 (negative): ", err, 1, true)
    assert.matches("dimension 1 is -1", err, 1, true)
  end)

  it("names the position of a record with a bad dtype, name or shape", function()
    local bad_records = {
      { { "good", "int8", { 1 } }, { "odd", "int7", { 1 } } },
      { { "good", "int8", { 1 } }, { nil, "int8", { 1 } } },
      { { "good", "int8", { 1 } }, { "flat", "int8", 5 } },
    }
    for _, records in ipairs(bad_records) do
      local ok, err = pcall(manifest.of, records)
      assert.is_false(ok)
      assert.matches("manifest record 2 ", tostring(err), 1, true)
    end
  end)
end)
