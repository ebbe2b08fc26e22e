--- What the GPU tier's specs share: whether a device is usable (and why not),
--- host memory with known bytes, comparisons that say where two byte strings
--- first differ, hex for handing handles to child processes, and device free
--- memory.
local ffi = require("ffi")
local C = (function()
  local ok, module = pcall(require, "wsync.native.ffi")
  return ok and module or require("wsync.ffi")
end)()
local device = require("wsync._device")

local M = {}

M.C = C

--- The number of CUDA devices, and the core's reason when there is none.
---@return integer count
---@return string? reason
function M.devices()
  local count_out = ffi.new("int[1]", 0)
  local status = C.ws_device_count(C.WS_BACKEND_CUDA, count_out)
  if status ~= 0 then
    return 0, ffi.string(C.ws_error_detail())
  end
  if count_out[0] == 0 then
    return 0, "the CUDA runtime sees 0 devices"
  end
  return count_out[0], nil
end

local anchors = {}

--- `size` bytes of host memory at a 64-byte boundary, filled with `fill`,
--- alive until the process ends.
function M.bytes(size, fill)
  local block = ffi.new("uint8_t[?]", size + 64)
  anchors[#anchors + 1] = block
  local data = block + (64 - tonumber(ffi.cast("uintptr_t", block) % 64)) % 64
  ffi.fill(data, size, fill or 0)
  return data
end

--- `size` bytes of host memory with varied contents (wsync's synthetic
--- bfloat16 values of tensor `name`).
function M.pattern(size, name)
  local data = M.bytes(size + 2)
  name = name or "pattern"
  assert(C.ws_synth_fill(data, C.WS_DTYPE_BFLOAT16, C.ws_synth_seed(name, #name), 0, math.ceil(size / 2), 1) == 0)
  return data
end

--- The 0-based offset where two strings first differ, or nil when equal.
function M.first_difference(a, b)
  if a == b then
    return nil
  end
  local n = math.min(#a, #b)
  local low, high = 0, n
  -- Bisect on prefixes: equal prefixes compare fast as strings.
  while high - low > 64 do
    local middle = math.floor((low + high) / 2)
    if a:sub(1, middle) == b:sub(1, middle) then
      low = middle
    else
      high = middle
    end
  end
  for i = low + 1, n do
    if a:byte(i) ~= b:byte(i) then
      return i - 1
    end
  end
  return n
end

--- Asserts two byte strings are equal, naming the first differing offset.
function M.assert_same(want, got, what)
  local at = M.first_difference(want, got)
  if at ~= nil then
    error(string.format("%s: the bytes differ first at offset %d (want %s, got %s; %d and %d bytes)", what, at,
      tostring(want:byte(at + 1)), tostring(got:byte(at + 1)), #want, #got), 2)
  end
end

M.hex = require("wsync.native.digest").hex
M.unhex = require("wsync.native.digest").unhex

--- Free bytes on CUDA device `index` (cudaMemGetInfo).
function M.free_bytes(index)
  return assert(device.query("cuda", index)).free_bytes
end

return M
