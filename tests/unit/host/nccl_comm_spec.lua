-- NCCL loading and communicators (host/nccl_comm.c) through the FFI and in
-- child processes, without a GPU: the binary starts and runs without NCCL;
-- asking for NCCL where it is missing, or is no NCCL, is a clean WS_ENODEV
-- naming the library; arguments are checked before anything is loaded.
local ffi = require("ffi")
local C = (function()
  local ok, module = pcall(require, "wsync.native.ffi")
  return ok and module or require("wsync.ffi")
end)()
local process = require("tests.helpers.process")

local function detail()
  return ffi.string(C.ws_error_detail())
end

-- A child wsync that loads NCCL through the binding and says how it went,
-- after doing some host-backend work (the binary runs without NCCL).
local CHILD = [[
  local device = require("wsync._device")
  assert(device.query("host", 0).uuid)
  local nccl = require("wsync._nccl")
  local ok, message, code = nccl.load()
  print(ok and "loaded" or code, message)
  local id, why, id_code = nccl.unique_id()
  print(id and "id" or id_code, why)
]]

local function child(library)
  return process.wsync({ "-e", CHILD }, nil, { env = { "WSYNC_NCCL_LIBRARY=" .. library } })
end

local built = C.ws_device_cuda_built() == 1

describe("nccl without the library", function()
  it("runs the binary and answers ENODEV naming the missing file", function()
    local result = child("/nonexistent/libnccl.so.2")
    assert.are.equal(0, result.code, result.stderr)
    local first, second = result.stdout:match("^([^\n]*)\n([^\n]*)\n$")
    assert.is_string(first, result.stdout)
    if built then
      assert.matches("^ENODEV\tnccl: cannot load /nonexistent/libnccl.so.2 %(NCCL is needed for trainer ranks",
        first)
      assert.matches("No such file or directory", first, 1, true)
    else
      assert.matches("^ENODEV\tnccl: this wsync was built without CUDA", first)
    end
    assert.are.equal(first, second)
  end)

  it("answers ENODEV naming the first missing function of a library that is not NCCL", function()
    local result = child("libc.so.6")
    assert.are.equal(0, result.code, result.stderr)
    if built then
      assert.matches("^ENODEV\tnccl: libc.so.6 has no ncclGetVersion %(wsync needs NCCL 2.x%)\n", result.stdout)
    else
      assert.matches("^ENODEV\tnccl: this wsync was built without CUDA", result.stdout)
    end
  end)
end)

describe("nccl communicators", function()
  it("refuse a rank outside the world before loading anything", function()
    local out = ffi.new("ws_nccl_comm *[1]")
    local id = ffi.new("unsigned char[?]", C.WS_NCCL_UNIQUE_ID_BYTES)
    for _, case in ipairs({ { 2, 2 }, { -1, 2 }, { 0, 0 } }) do
      local status = C.ws_nccl_comm_init(0, case[2], case[1], id, 0, out)
      if built then
        assert.are.equal(C.WS_EINVAL, status)
        assert.matches(string.format("nccl: rank %d of a world of %d", case[1], case[2]), detail(), 1, true)
      else
        assert.are.equal(C.WS_ENODEV, status)
      end
    end
  end)

  -- Loading NCCL runs in children (tests/memcheck.sh runs this tier under
  -- valgrind, its children natively): NCCL's own threads and caches are no
  -- concern of wsync's leak checks.
  describe("without a usable GPU", function()
    local count = ffi.new("int[1]", -1)
    if C.ws_device_count(C.WS_BACKEND_CUDA, count) == 0 and count[0] > 0 then
      pending("a CUDA device is present: tests/gpu covers NCCL")
      return
    end

    it("answer ENODEV for a communicator, naming what is missing", function()
      local result = process.wsync({ "-e", [[
        local nccl = require("wsync._nccl")
        print(select(2, nccl.init(0, 1, 0, string.rep("\0", 128))))
        print(select(3, nccl.init(0, 1, 0, string.rep("\0", 128))))]] })
      assert.are.equal(0, result.code, result.stderr)
      local text, code = result.stdout:match("^([^\n]*)\n([^\n]*)\n$")
      assert.are.equal("ENODEV", code, result.stdout)
      local named = text:find("cudaError", 1, true) or text:find("no CUDA device", 1, true)
        or text:find("cannot load", 1, true) or text:find("built without CUDA", 1, true)
      assert.is_truthy(named, text)
    end)
  end)

  it("report a 2.x version and make a new 128-byte unique id each time, where NCCL loads", function()
    local result = process.wsync({ "-e", [[
      local nccl = require("wsync._nccl")
      local ok, message = nccl.load()
      if not ok then
        print("missing", message)
        return
      end
      local first, second = assert(nccl.unique_id()), assert(nccl.unique_id())
      print(nccl.version(), #first, #second, first ~= second)]] })
    assert.are.equal(0, result.code, result.stderr)
    if result.stdout:match("^missing") then
      pending("NCCL does not load here: " .. result.stdout)
      return
    end
    local version, first, second, differ = result.stdout:match("^(%d+)\t(%d+)\t(%d+)\t(%a+)\n$")
    assert.is_string(version, result.stdout)
    assert.is_true(tonumber(version) >= 20000 and tonumber(version) < 30000, version)
    assert.are.equal("128", first)
    assert.are.equal("128", second)
    assert.are.equal("true", differ)
  end)
end)
