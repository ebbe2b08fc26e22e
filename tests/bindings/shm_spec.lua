-- `wsync._shm`: buffers from Lua, their checks, and what close and __gc free.
local ffi = require("ffi")
local uv = require("luv")
local shm = require("wsync._shm")
local manifest = require("wsync._manifest")
local shm_files = require("tests.helpers.shm")

local pid = uv.os_getpid()

describe("wsync._shm", function()
  it("creates a named buffer and reports its name, size and ownership", function()
    local buffer = assert(shm.create(4096))
    assert.matches(shm_files.name_pattern(pid), buffer:name())
    assert.are.equal(4096, buffer:size())
    assert.is_true(buffer:is_owner())
    assert.are.equal("wsync.shm " .. buffer:name() .. " (4096 bytes)", tostring(buffer))
    assert.is_table(shm_files.stat(buffer:name()))
    assert.is_true(buffer:close())
    assert.are.equal("wsync.shm (closed)", tostring(buffer))
  end)

  it("round-trips bytes through an importer and through pointer()", function()
    local buffer = assert(shm.create(4096))
    local peer = assert(shm.open(buffer:name()))
    assert.is_false(peer:is_owner())
    buffer:write(100, "hello\0world")
    assert.are.equal("hello\0world", peer:read(100, 11))
    assert.are.equal(string.rep("\0", 4), peer:read(0, 4))
    local bytes = ffi.cast("uint8_t *", peer:pointer())
    assert.are.equal(string.byte("h"), bytes[100])
    bytes[4095] = 0x7f
    assert.are.equal("\127", buffer:read(4095, 1))
    assert.are.equal("", buffer:read(4096, 0))
    assert.is_true(peer:close())
    assert.is_true(buffer:close())
  end)

  it("raises on reads and writes outside the buffer", function()
    local buffer = assert(shm.create(64))
    local cases = {
      function() buffer:read(-1, 1) end,
      function() buffer:read(0, 65) end,
      function() buffer:read(60, 5) end,
      function() buffer:read(0.5, 1) end,
      function() buffer:read(0, -1) end,
      function() buffer:read(0, 0 / 0) end,
      function() buffer:read(0 / 0, 1) end,
      function() buffer:read(0, 1.5) end,
      function() buffer:write(63, "ab") end,
      function() buffer:write(-1, "a") end,
      function() buffer:write(2 ^ 60, "a") end,
    }
    for index, case in ipairs(cases) do
      local ok, err = pcall(case)
      assert.is_false(ok, "case " .. index .. " did not raise")
      assert.matches("outside the 64%-byte buffer", err)
    end
    assert.has_error(function()
      buffer:read("x", 1)
    end, "bad argument #1 to 'read' (number expected, got string)")
    assert.has_error(function()
      buffer:write(0, {})
    end, "bad argument #2 to 'write' (string expected, got table)")
    buffer:close()
  end)

  it("raises on sizes that are not positive integers", function()
    for _, size in ipairs({ 0, -1, 1.5, 0 / 0 }) do
      assert.has_error(function()
        shm.create(size)
      end, "bad argument #1 to 'create' (size must be a positive integer)")
    end
    assert.has_error(function()
      shm.create("big")
    end, "bad argument #1 to 'create' (number expected, got string)")
  end)

  it("returns nil, message, CODE when a buffer cannot be made or found", function()
    local result, message, code = shm.open("not-a-name")
    assert.is_nil(result)
    assert.are.equal("EINVAL", code)
    assert.matches("is not a segment name", message, 1, true)
    result, message, code = shm.open("/wsync-" .. pid .. "-ffffffffffffffff")
    assert.is_nil(result)
    assert.are.equal("ENOTFOUND", code)
    assert.matches("No such file", message, 1, true)
    result, message, code = shm.create(2 ^ 62)
    assert.is_nil(result)
    assert.are.equal("ESYS", code)
    assert.matches("cannot reserve", message, 1, true)
  end)

  it("unlinks on request: the name goes, the mapping stays", function()
    local buffer = assert(shm.create(32))
    local name = buffer:name()
    assert.is_true(buffer:unlink())
    assert.is_true(buffer:unlink())
    assert.is_nil(shm_files.stat(name))
    local result, _, code = shm.open(name)
    assert.is_nil(result)
    assert.are.equal("ENOTFOUND", code)
    buffer:write(0, "still mapped")
    assert.are.equal("still mapped", buffer:read(0, 12))
    assert.is_true(buffer:close())
  end)

  it("raises 'wsync.shm is closed' after close; a second close is fine", function()
    local buffer = assert(shm.create(32))
    assert.is_true(buffer:close())
    assert.is_true(buffer:close())
    assert.has_error(function()
      buffer.read(buffer, 0, 1)
    end, "bad argument #1 to 'read' (wsync.shm is closed)")
    for _, method in ipairs({ "name", "size", "is_owner", "pointer", "write", "read", "unlink" }) do
      local ok, err = pcall(buffer[method], buffer, 0, "x")
      assert.is_false(ok, method)
      assert.matches("bad argument #1 to '?' (wsync.shm is closed)", err, 1, true)
    end
  end)

  it("refuses an object of another class", function()
    local buffer = assert(shm.create(32))
    local other = assert(manifest.new())
    assert.has_error(function()
      buffer.size(other)
    end, "bad argument #1 to 'size' (wsync.shm expected, got userdata)")
    assert.has_error(function()
      buffer.close("x")
    end, "bad argument #1 to 'close' (wsync.shm expected, got string)")
    other:close()
    buffer:close()
  end)

  it("lets the collector unmap and unlink buffers that were never closed", function()
    local names = {}
    for i = 1, 50 do
      local buffer = assert(shm.create(4096))
      names[i] = buffer:name()
    end
    collectgarbage()
    collectgarbage()
    for _, name in ipairs(names) do
      assert.is_nil(shm_files.stat(name), name .. " outlived its buffer")
    end
  end)

  it("lets the collector close an importer without unlinking the owner's name", function()
    local buffer = assert(shm.create(64))
    do
      local peer = assert(shm.open(buffer:name()))
      peer:write(0, "x")
    end
    collectgarbage()
    collectgarbage()
    assert.is_table(shm_files.stat(buffer:name()))
    buffer:close()
  end)
end)
