-- `wsync._manifest`: argument checks raise, refusals return nil, message, CODE.
local native = require("wsync._manifest")
local shm = require("wsync._shm")
local core = require("tests.helpers.core_manifest")

local function new()
  return assert(native.new())
end

describe("wsync._manifest", function()
  it("hashes like the core, and add returns the manifest for chaining", function()
    local manifest = new()
    for _, record in ipairs(core.sample) do
      assert.are.equal(manifest, manifest:add(record[1], record[2], record[3]))
    end
    local digest, count, bytes = core.digest(core.sample)
    assert.are.equal(digest, manifest:finish())
    assert.are.equal(digest, manifest:finish())
    assert.are.equal(count, manifest:count())
    assert.are.equal(bytes, manifest:bytes())
    manifest:close()
  end)

  it("has a readable tostring, open and closed", function()
    local manifest = new()
    manifest:add("a", "int8", { 1 }):add("b", "int8", { 2 })
    assert.are.equal("wsync.manifest (2 records)", tostring(manifest))
    manifest:close()
    assert.are.equal("wsync.manifest (closed)", tostring(manifest))
  end)

  it("raises on arguments of the wrong type, naming them", function()
    local manifest = new()
    local cases = {
      { function() manifest:add(nil, "int8", { 1 }) end, "bad argument #1 to 'add' (string expected, got nil)" },
      { function() manifest:add("w", "int7", { 1 }) end, "bad argument #2 to 'add' (unknown dtype 'int7')" },
      { function() manifest:add("w", 8, { 1 }) end, "bad argument #2 to 'add' (unknown dtype '8')" },
      { function() manifest:add("w", "int8", 4) end, "bad argument #3 to 'add' (table expected, got number)" },
      { function() manifest:add("w", "int8", { 1, 1, 1, 1, 1, 1, 1, 1, 1 }) end,
        "bad argument #3 to 'add' (shape has 9 dimensions, at most 8)" },
      { function() manifest:add("w", "int8", { 1, "x" }) end, "bad argument #3 to 'add' (shape[2] is not a number)" },
      { function() manifest:add("w", "int8", { 1.5 }) end, "bad argument #3 to 'add' (shape[1] is not an integer)" },
      { function() manifest:add("w", "int8", { 0 / 0 }) end, "bad argument #3 to 'add' (shape[1] is not an integer)" },
      { function() manifest.add(42, "w", "int8", { 1 }) end,
        "bad argument #1 to 'add' (wsync.manifest expected, got number)" },
    }
    for _, case in ipairs(cases) do
      assert.has_error(case[1], case[2])
    end
    assert.are.equal(0, manifest:count())
    manifest:close()
  end)

  it("refuses an object of another class", function()
    local buffer = assert(shm.create(16))
    assert.has_error(function()
      native.new().finish(buffer)
    end, "bad argument #1 to 'finish' (wsync.manifest expected, got userdata)")
    buffer:close()
    collectgarbage()
  end)

  it("returns nil, message, CODE for records the core refuses", function()
    local manifest = new()
    local result, message, code = manifest:add("neg", "int8", { 2, -1 })
    assert.is_nil(result)
    assert.are.equal("EINVAL", code)
    assert.matches("'neg' dimension 1 is -1", message, 1, true)
    result, message, code = manifest:add("", "int8", { 1 })
    assert.is_nil(result)
    assert.are.equal("EINVAL", code)
    assert.matches("record name length 0 is invalid", message, 1, true)
    result, message, code = manifest:add("huge", "int8", { 2 ^ 40, 2 ^ 40 })
    assert.is_nil(result)
    assert.are.equal("EOVERFLOW", code)
    assert.matches("overflows", message, 1, true)
    manifest:finish()
    result, message, code = manifest:add("late", "int8", { 1 })
    assert.is_nil(result)
    assert.are.equal("ESTATE", code)
    assert.matches("after finish", message, 1, true)
    manifest:close()
  end)

  it("raises 'wsync.manifest is closed' after close; a second close is fine", function()
    local manifest = new()
    manifest:close()
    assert.has_no.errors(function()
      manifest:close()
    end)
    assert.has_error(function()
      manifest:finish()
    end, "calling 'finish' on bad self (wsync.manifest is closed)")
    assert.has_error(function()
      manifest.count(manifest)
    end, "bad argument #1 to 'count' (wsync.manifest is closed)")
    for _, method in ipairs({ "add", "finish", "count", "bytes" }) do
      local ok, err = pcall(manifest[method], manifest, "w", "int8", { 1 })
      assert.is_false(ok, method)
      assert.matches("bad argument #1 to '?' (wsync.manifest is closed)", err, 1, true)
    end
  end)

  it("frees unclosed manifests from the collector without trouble", function()
    for _ = 1, 200 do
      native.new():add("w", "int8", { 1 })
    end
    assert.has_no.errors(function()
      collectgarbage()
      collectgarbage()
    end)
  end)
end)
