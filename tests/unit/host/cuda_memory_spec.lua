-- The cuda backend's device memory (host/cuda_memory.c) through the FFI, where
-- no GPU is usable: every entry point answers a clean WS_ENODEV naming the
-- reason (a build without CUDA, no driver, no device), arguments are checked
-- before any device is looked for, and nothing is counted as allocated.
local ffi = require("ffi")
local C = (function()
  local ok, module = pcall(require, "wsync.native.ffi")
  return ok and module or require("wsync.ffi")
end)()

local function detail()
  return ffi.string(C.ws_error_detail())
end

local reasons = { "built without CUDA", "cudaErrorNoDevice", "cudaErrorInsufficientDriver", "no CUDA device" }

local function assert_no_device(status)
  assert.are.equal(C.WS_ENODEV, status, detail())
  local text = detail()
  assert.matches("^cuda", text)
  local named = false
  for _, reason in ipairs(reasons) do
    named = named or text:find(reason, 1, true) ~= nil
  end
  assert.is_true(named, "no reason in: " .. text)
end

describe("cuda memory, on any machine", function()
  it("refuses a buffer of no bytes before it looks for a device", function()
    local out = ffi.new("ws_cuda_buffer *[1]")
    assert.are.equal(C.WS_EINVAL, C.ws_cuda_buffer_create(0, 0, out))
    assert.matches("positive size", detail(), 1, true)
    local mapping = ffi.new("ws_cuda_mapping *[1]")
    assert.are.equal(C.WS_EINVAL, C.ws_cuda_mapping_open(0, ffi.new("unsigned char[64]"), 0, mapping))
  end)

  it("refuses a read or write past a region before it touches it", function()
    local region = ffi.new("ws_cuda_region")
    region.pointer, region.size = 4096, 100
    local out = ffi.new("uint8_t[8]")
    assert.are.equal(C.WS_EINVAL, C.ws_cuda_read(region, 96, out, 8, nil))
    assert.matches("cuda: read range [96, +8) exceeds the 100-byte region", detail(), 1, true)
    assert.are.equal(C.WS_EINVAL, C.ws_cuda_write(region, 101, out, 0, nil))
    assert.are.equal(C.WS_EINVAL, C.ws_cuda_memset(region, 0, 101, 0, nil))
  end)

  it("accepts closing nothing", function()
    assert.are.equal(0, C.ws_cuda_buffer_close(nil))
    assert.are.equal(0, C.ws_cuda_mapping_close(nil))
    assert.are.equal(0, C.ws_cuda_stream_destroy(nil))
    assert.are.equal(0, C.ws_cuda_event_destroy(nil))
    assert.are.equal(0, C.ws_cuda_copy_plan_close(nil))
    assert.are.equal(0, C.ws_cuda_synth_plan_close(nil))
    assert.are.equal(0, C.ws_nccl_comm_destroy(nil))
    assert.are.equal(0, C.ws_nccl_comm_abort(nil))
  end)
end)

describe("cuda memory without a usable GPU", function()
  local count = ffi.new("int[1]", -1)
  if C.ws_device_count(C.WS_BACKEND_CUDA, count) == 0 and count[0] > 0 then
    pending("a CUDA device is present: tests/gpu covers the cuda backend")
    return
  end

  it("answers WS_ENODEV with the reason for buffers, imports, streams and events", function()
    assert_no_device(C.ws_cuda_buffer_create(0, 4096, ffi.new("ws_cuda_buffer *[1]")))
    assert_no_device(C.ws_cuda_mapping_open(0, ffi.new("unsigned char[64]"), 4096, ffi.new("ws_cuda_mapping *[1]")))
    assert_no_device(C.ws_cuda_stream_create(0, ffi.new("ws_cuda_stream *[1]")))
    assert_no_device(C.ws_cuda_event_create(0, 1, ffi.new("ws_cuda_event *[1]")))
  end)

  it("answers WS_ENODEV for a valid plan and for small copies", function()
    local region = ffi.new("ws_cuda_region[1]")
    region[0].pointer, region[0].size = 4096, 4096
    local ops = ffi.new("ws_cuda_copy_op[1]")
    ops[0].rows, ops[0].width, ops[0].target_pitch, ops[0].source_pitch = 1, 64, 64, 64
    assert_no_device(C.ws_cuda_copy_plan_create(0, region, 1, ops, 1, ffi.new("ws_cuda_copy_plan *[1]")))
    local synth = ffi.new("ws_cuda_synth_op[1]")
    synth[0].dtype, synth[0].rows, synth[0].row_elements = C.WS_DTYPE_BFLOAT16, 1, 8
    assert_no_device(C.ws_cuda_synth_plan_create(0, region, 1, synth, 1, ffi.new("ws_cuda_synth_plan *[1]")))
    assert_no_device(C.ws_cuda_read(region, 0, ffi.new("uint8_t[8]"), 8, nil))
    assert_no_device(C.ws_cuda_memcpy(region, 0, region, 64, 64, nil))
  end)

  it("counts nothing allocated, exported or mapped", function()
    local counters = ffi.new("ws_cuda_counters")
    C.ws_cuda_counters_get(counters)
    for _, field in ipairs({ "allocations", "frees", "live_bytes", "exports", "ipc_opens", "ipc_closes",
      "mappings_reused", "live_mappings", "launches" }) do
      assert.are.equal(0, tonumber(counters[field]), field)
    end
  end)
end)
