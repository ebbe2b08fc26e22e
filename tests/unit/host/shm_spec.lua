-- Shared-memory buffers of the host backend, through the FFI.
local bit = require("bit")
local ffi = require("ffi")
local uv = require("luv")
local C = require("wsync.native.ffi")
local shm_files = require("tests.helpers.shm")

local pid = uv.os_getpid()

local function detail()
  return ffi.string(C.ws_error_detail())
end

local function create(size)
  local out = ffi.new("ws_shm *[1]")
  local status = C.ws_shm_create(size, out)
  assert(status == 0, "ws_shm_create: " .. detail())
  return out[0]
end

local function open(name)
  local out = ffi.new("ws_shm *[1]")
  local status = C.ws_shm_open(name, out)
  return status, out[0]
end

local function bytes_of(shm)
  return ffi.cast("uint8_t *", C.ws_shm_data(shm))
end

describe("shm", function()
  it("creates a zero-filled, private, named segment of the asked size", function()
    local shm = create(8192)
    local name = ffi.string(C.ws_shm_name(shm))
    assert.matches(shm_files.name_pattern(pid), name)
    assert.are.equal(8192, tonumber(C.ws_shm_size(shm)))
    assert.are.equal(1, C.ws_shm_is_owner(shm))
    local data = bytes_of(shm)
    assert.is_false(data == nil)
    local nonzero = 0
    for i = 0, 8191 do
      if data[i] ~= 0 then
        nonzero = nonzero + 1
      end
    end
    assert.are.equal(0, nonzero)
    local stat = assert(shm_files.stat(name))
    assert.are.equal(8192, stat.size)
    assert.are.equal(tonumber("600", 8), bit.band(stat.mode, tonumber("777", 8)))
    assert.are.equal(0, C.ws_shm_close(shm))
  end)

  it("gives each segment a fresh name", function()
    local first, second = create(16), create(16)
    assert.are_not.equal(ffi.string(C.ws_shm_name(first)), ffi.string(C.ws_shm_name(second)))
    assert.are.equal(0, C.ws_shm_close(first))
    assert.are.equal(0, C.ws_shm_close(second))
  end)

  it("shares bytes between the creator and an importer", function()
    local owner = create(4096)
    local name = ffi.string(C.ws_shm_name(owner))
    local status, importer = open(name)
    assert.are.equal(0, status, detail())
    assert.are.equal(0, C.ws_shm_is_owner(importer))
    assert.are.equal(4096, tonumber(C.ws_shm_size(importer)))
    assert.are.equal(name, ffi.string(C.ws_shm_name(importer)))
    assert.is_false(C.ws_shm_data(owner) == C.ws_shm_data(importer))

    ffi.copy(bytes_of(owner) + 4000, "wsync\0bytes", 11)
    assert.are.equal("wsync\0bytes", ffi.string(bytes_of(importer) + 4000, 11))
    bytes_of(importer)[4095] = 0xab
    assert.are.equal(0xab, bytes_of(owner)[4095])

    assert.are.equal(0, C.ws_shm_close(importer))
    assert.are.equal(0, C.ws_shm_close(owner))
  end)

  it("keeps mappings after unlink, and refuses to open the name with WS_ENOTFOUND", function()
    local owner = create(64)
    local name = ffi.string(C.ws_shm_name(owner))
    local _, importer = open(name)
    assert.are.equal(0, C.ws_shm_unlink(owner))
    assert.is_nil(shm_files.stat(name))
    assert.are.equal(0, C.ws_shm_unlink(owner)) -- a second unlink is a no-op
    local status = open(name)
    assert.are.equal(C.WS_ENOTFOUND, status)
    assert.matches("shm_open " .. name, detail(), 1, true)
    bytes_of(owner)[10] = 42
    assert.are.equal(42, bytes_of(importer)[10])
    assert.are.equal(0, C.ws_shm_close(importer))
    assert.are.equal(0, C.ws_shm_close(owner))
  end)

  it("unlinks the name when the owner closes", function()
    local owner = create(64)
    local name = ffi.string(C.ws_shm_name(owner))
    assert.is_table(shm_files.stat(name))
    assert.are.equal(0, C.ws_shm_close(owner))
    assert.is_nil(shm_files.stat(name))
    assert.are.equal(C.WS_ENOTFOUND, (open(name)))
  end)

  it("leaves the name in place when an importer closes", function()
    local owner = create(64)
    local name = ffi.string(C.ws_shm_name(owner))
    local status, importer = open(name)
    assert.are.equal(0, status)
    assert.are.equal(0, C.ws_shm_close(importer))
    assert.is_table(shm_files.stat(name))
    local again_status, again = open(name)
    assert.are.equal(0, again_status)
    assert.are.equal(0, C.ws_shm_close(again))
    assert.are.equal(0, C.ws_shm_close(owner))
    assert.is_nil(shm_files.stat(name))
  end)

  it("rejects names that are not '/name' under WS_SHM_NAME_MAX bytes", function()
    local long = "/" .. string.rep("n", tonumber(C.WS_SHM_NAME_MAX) - 1)
    for _, name in ipairs({ "", "/", "wsync-no-slash", "/wsync/nested", long }) do
      local status, shm = open(name)
      assert.are.equal(C.WS_EINVAL, status, name)
      assert.is_true(shm == nil)
      assert.matches("is not a segment name", detail(), 1, true)
    end
  end)

  it("answers WS_ENOTFOUND for a well-formed name that does not exist", function()
    local status = open("/wsync-" .. pid .. "-0000000000000000")
    assert.are.equal(C.WS_ENOTFOUND, status)
  end)

  it("rejects size 0", function()
    local out = ffi.new("ws_shm *[1]")
    assert.are.equal(C.WS_EINVAL, C.ws_shm_create(0, out))
    assert.is_true(out[0] == nil)
    assert.matches("size must be positive", detail(), 1, true)
  end)

  it("fails cleanly, leaving no segment, when the size cannot be reserved", function()
    local out = ffi.new("ws_shm *[1]")
    local status = C.ws_shm_create(ffi.cast("size_t", -1) / 2, out)
    assert.are.equal(C.WS_ESYS, status)
    assert.is_true(out[0] == nil)
    assert.matches("cannot reserve", detail(), 1, true)
  end)

  it("closes NULL", function()
    assert.are.equal(0, C.ws_shm_close(nil))
  end)
end)
