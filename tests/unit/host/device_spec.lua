-- Device identity and memory through the FFI: the host backend everywhere, the
-- cuda backend's refusal where no GPU is usable.
local ffi = require("ffi")
local C = require("wsync.native.ffi")
local process = require("tests.helpers.process")

local uuid_pattern = "^%x%x%x%x%x%x%x%x%-%x%x%x%x%-%x%x%x%x%-%x%x%x%x%-%x%x%x%x%x%x%x%x%x%x%x%x$"

local function detail()
  return ffi.string(C.ws_error_detail())
end

local function query(backend, index)
  local info = ffi.new("ws_device_info")
  local status = C.ws_device_query(backend, index, info)
  return status, info
end

describe("host backend", function()
  it("has WS_HOST_DEVICE_MAX devices", function()
    local count = ffi.new("int[1]", -1)
    assert.are.equal(0, C.ws_device_count(C.WS_BACKEND_HOST, count))
    assert.are.equal(tonumber(C.WS_HOST_DEVICE_MAX), count[0])
    assert.is_true(count[0] >= 8)
  end)

  it("gives each index a lowercase UUID, a name and memory figures", function()
    local seen = {}
    for index = 0, 7 do
      local status, info = query(C.WS_BACKEND_HOST, index)
      assert.are.equal(0, status, detail())
      local uuid = ffi.string(info.uuid)
      assert.matches(uuid_pattern, uuid)
      assert.are.equal(uuid:lower(), uuid)
      assert.are.equal(index, info.index)
      assert.are.equal("host" .. index, ffi.string(info.name))
      assert.is_true(info.total_bytes > 0)
      assert.is_true(info.total_bytes >= info.free_bytes)
      assert.is_nil(seen[uuid], "index " .. index .. " repeats a UUID")
      seen[uuid] = index
    end
  end)

  it("answers the same UUID for the same index every time", function()
    local _, first = query(C.WS_BACKEND_HOST, 3)
    local _, second = query(C.WS_BACKEND_HOST, 3)
    assert.are.equal(ffi.string(first.uuid), ffi.string(second.uuid))
  end)

  it("answers the same UUIDs in another process", function()
    local here = {}
    for index = 0, 3 do
      local _, info = query(C.WS_BACKEND_HOST, index)
      here[#here + 1] = ffi.string(info.uuid)
    end
    local result = process.wsync({ "-e", [[
      local ffi = require("ffi")
      local C = require("wsync.native.ffi")
      for index = 0, 3 do
        local info = ffi.new("ws_device_info")
        assert(C.ws_device_query(C.WS_BACKEND_HOST, index, info) == 0)
        print(ffi.string(info.uuid))
      end]] })
    assert.are.equal(0, result.code, result.stderr)
    assert.are.equal(table.concat(here, "\n") .. "\n", result.stdout)
  end)

  it("refuses indices out of range with WS_EINVAL", function()
    for _, index in ipairs({ -1, tonumber(C.WS_HOST_DEVICE_MAX), 100000 }) do
      local status = query(C.WS_BACKEND_HOST, index)
      assert.are.equal(C.WS_EINVAL, status)
      assert.matches("device " .. index .. " out of range", detail(), 1, true)
    end
  end)

  it("refuses an unknown backend with WS_EINVAL", function()
    local count = ffi.new("int[1]")
    assert.are.equal(C.WS_EINVAL, C.ws_device_count(7, count))
    assert.matches("unknown backend 7", detail(), 1, true)
    assert.are.equal(C.WS_EINVAL, (query(7, 0)))
  end)
end)

describe("cuda backend without a usable GPU", function()
  local count = ffi.new("int[1]", -1)
  local status = C.ws_device_count(C.WS_BACKEND_CUDA, count)
  if status == 0 and count[0] > 0 then
    pending("a CUDA device is present: tests/gpu covers the cuda backend")
    return
  end

  it("answers WS_ENODEV with the reason, for count and query alike", function()
    assert.are.equal(C.WS_ENODEV, C.ws_device_count(C.WS_BACKEND_CUDA, count))
    assert.are.equal(C.WS_ENODEV, status)
    local count_detail = detail()
    assert.matches("^cuda backend: ", count_detail)
    local reasons = { "without CUDA", "cudaErrorNoDevice", "cudaErrorInsufficientDriver" }
    local named = false
    for _, reason in ipairs(reasons) do
      named = named or count_detail:find(reason, 1, true) ~= nil
    end
    assert.is_true(named, "no reason in: " .. count_detail)
    assert.are.equal(C.WS_ENODEV, (query(C.WS_BACKEND_CUDA, 0)))
    assert.are.equal(count_detail, detail())
  end)
end)
