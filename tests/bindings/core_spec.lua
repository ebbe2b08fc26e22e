-- `wsync._core`: version, status table, build features, ffi declarations.
local ffi = require("ffi")
local core = require("wsync._core")
local C = require("wsync.native.ffi")

describe("wsync._core", function()
  it("carries the project version from CMakeLists.txt", function()
    local file = assert(io.open("CMakeLists.txt"))
    local version = file:read("*a"):match("project%(wsync VERSION ([%d%.]+)")
    file:close()
    assert.is_string(version)
    assert.are.equal(version, core.version)
    assert.are.equal(version, ffi.string(C.ws_version()))
  end)

  it("maps every status name to its code, and back", function()
    local count = 0
    for name, code in pairs(core.status) do
      assert.are.equal(name, core.status_name(code))
      assert.are.equal(ffi.string(C.ws_status_message(code)), core.status_message(code))
      assert.are.equal(code, tonumber(C["WS_" .. name]))
      count = count + 1
    end
    assert.are.equal(0, core.status.OK)
    assert.are.equal(-1, core.status.EINVAL)
    assert.is_true(count >= 14)
  end)

  it("answers EUNKNOWN for codes outside the table", function()
    assert.are.equal("EUNKNOWN", core.status_name(12345))
    assert.are.equal("unknown status", core.status_message(-12345))
  end)

  it("raises on a code that is not a number", function()
    assert.has_error(function()
      core.status_name("EINVAL")
    end, "bad argument #1 to 'status_name' (number expected, got string)")
    assert.has_error(function()
      core.status_message()
    end, "bad argument #1 to 'status_message' (number expected, got no value)")
  end)

  it("says whether the cuda backend was built, as wsync does", function()
    assert.is_boolean(core.cuda_built)
    assert.are.equal(core.cuda_built, require("wsync").cuda_built)
    assert.are.equal(core.cuda_built and 1 or 0, C.ws_device_cuda_built())
  end)

  it("carries the core's declarations for ffi.cdef without preprocessor lines", function()
    assert.is_string(core.cdef)
    for _, name in ipairs({ "ws_manifest_new", "ws_shm_create", "ws_device_query", "ws_host_open", "WS_EINVAL" }) do
      assert.matches(name, core.cdef, 1, true)
    end
    assert.is_nil(core.cdef:match("\n%s*#"))
  end)

  it("hands over the core's function table, one pointer per declared function", function()
    assert.are.equal("userdata", type(core.api))
    local api = ffi.cast("const ws_core_api *", core.api)
    -- The same functions that the binary exports to ffi.C.
    assert.are.equal("EINVAL", ffi.string(api.ws_status_name(-1)))
    assert.are.equal(ffi.cast("void *", ffi.C.ws_status_name), ffi.cast("void *", api.ws_status_name))
    assert.are.equal(ffi.cast("void *", ffi.C.ws_host_open), ffi.cast("void *", api.ws_host_open))
    -- Every function of the cdef has its field.
    local count = 0
    for name in core.cdef:gmatch("[%s%*](ws_[%w_]+)%(") do
      assert.is_true(pcall(function()
        return api[name]
      end), name .. " has no field in ws_core_api")
      count = count + 1
    end
    assert.is_true(count >= 50)
  end)
end)
