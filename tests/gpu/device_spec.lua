-- The cuda backend on a machine with a GPU: identity and memory per device.
-- Without a usable device the whole file is reported as pending, with the
-- reason the core gave.
local ffi = require("ffi")
local C = require("wsync.native.ffi")
local wsync = require("wsync")

local uuid_pattern = "^%x%x%x%x%x%x%x%x%-%x%x%x%x%-%x%x%x%x%-%x%x%x%x%-%x%x%x%x%x%x%x%x%x%x%x%x$"

local count_out = ffi.new("int[1]", 0)
local status = C.ws_device_count(C.WS_BACKEND_CUDA, count_out)
local count = count_out[0]
local reason = status ~= 0 and ffi.string(C.ws_error_detail()) or "the CUDA runtime sees 0 devices"

-- The UUIDs nvidia-smi lists ("GPU-" dropped), or nil without nvidia-smi.
local function driver_uuids()
  local pipe = io.popen("nvidia-smi --query-gpu=uuid --format=csv,noheader 2>/dev/null")
  local text = pipe and pipe:read("*a") or ""
  if pipe then
    pipe:close()
  end
  local uuids = {}
  for uuid in text:gmatch("GPU%-(%S+)") do
    uuids[uuid] = true
  end
  return next(uuids) and uuids or nil
end

describe("cuda devices", function()
  if status ~= 0 or count == 0 then
    pending("no CUDA device: " .. reason)
    return
  end

  local seen = {}
  for index = 0, count - 1 do
    it("device " .. index .. " has a UUID, a name and free <= total memory", function()
      local info, message, code = wsync.native.device.query("cuda", index)
      assert.is_table(info, tostring(message) .. " " .. tostring(code))
      assert.are.equal(index, info.index)
      assert.matches(uuid_pattern, info.uuid)
      assert.are.equal(info.uuid:lower(), info.uuid)
      assert.is_nil(info.uuid:find("GPU-", 1, true))
      assert.is_nil(seen[info.uuid], "device " .. index .. " repeats a UUID")
      seen[info.uuid] = index
      assert.is_string(info.name)
      assert.is_true(#info.name > 0)
      assert.is_true(info.free_bytes > 0)
      assert.is_true(info.total_bytes >= info.free_bytes)
      local again = assert(wsync.native.device.query("cuda", index))
      assert.are.equal(info.uuid, again.uuid)
    end)
  end

  it("writes UUIDs the way the driver does, without the GPU- prefix", function()
    local listed = driver_uuids()
    if not listed then
      pending("nvidia-smi is not available to compare UUIDs with")
      return
    end
    for index = 0, count - 1 do
      local uuid = assert(wsync.native.device.query("cuda", index)).uuid
      assert.is_true(listed[uuid] ~= nil, uuid .. " is not among nvidia-smi's UUIDs")
    end
  end)

  it("refuses an index past the last device", function()
    local info, message, code = wsync.native.device.query("cuda", count)
    assert.is_nil(info)
    assert.are.equal("EINVAL", code)
    assert.matches("out of range", message, 1, true)
  end)

  it("counts the same devices through Lua as through the core", function()
    assert.are.equal(count, wsync.native.device.count("cuda"))
  end)

  it("reads each device's memory through the driver (NVML): the CUDA runtime's total, and who holds it", function()
    local uv = require("luv")
    for index = 0, count - 1 do
      local info = assert(wsync.native.device.query("cuda", index)) -- (this process now has a context there)
      local memory, message, code = wsync.native.device.gpu_memory(info.uuid)
      assert.is_table(memory, tostring(message) .. " " .. tostring(code))
      -- (CUDA's total leaves out what the driver reserves, 615 MiB of an
      -- H200's 141 GB: NVML's memory info v2 names it, v1 counts it.)
      if memory.reserved_bytes > 0 then
        assert.is_true(math.abs(memory.total_bytes - info.total_bytes) < 64 * 2 ^ 20,
          string.format("NVML total %.0f (reserve %.0f apart), CUDA total %.0f", memory.total_bytes,
            memory.reserved_bytes, info.total_bytes))
      else
        assert.is_true(memory.total_bytes >= info.total_bytes)
      end
      assert.are.equal(memory.total_bytes - memory.free_bytes, memory.used_bytes)
      -- (Another process may allocate between the two reads: a few MiB apart at most here.)
      assert.is_true(math.abs(memory.free_bytes - info.free_bytes) < 64 * 2 ^ 20,
        string.format("NVML free %.0f, CUDA free %.0f", memory.free_bytes, info.free_bytes))
      local pids = {}
      for _, entry in ipairs(memory.processes or {}) do
        pids[#pids + 1] = string.format("%d:%s", entry.pid, tostring(entry.used_bytes))
      end
      local started = uv.hrtime()
      for _ = 1, 100 do
        assert(wsync.native.device.gpu_memory(info.uuid))
      end
      print(string.format("gpu_memory: device %d (%s): %.2f of %.2f GiB in use (the driver's reserve %.3f GiB "
        .. "apart; CUDA's total %.2f GiB); processes (pid:bytes, as the driver "
        .. "sees them; this one is %d): %s; %.1f us a sample", index, info.uuid, memory.used_bytes / 2 ^ 30,
        memory.total_bytes / 2 ^ 30, memory.reserved_bytes / 2 ^ 30, info.total_bytes / 2 ^ 30, uv.os_getpid(),
        table.concat(pids, " "), (uv.hrtime() - started) / 1e3 / 100))
    end
  end)

  it("names a GPU the driver does not have", function()
    local memory, message, code = wsync.native.device.gpu_memory("00000000-0000-0000-0000-000000000000")
    assert.is_nil(memory)
    assert.are.equal("ENOTFOUND", code)
    assert.matches("^nvml: no GPU GPU%-00000000%-0000%-0000%-0000%-000000000000: ", message)
  end)
end)

