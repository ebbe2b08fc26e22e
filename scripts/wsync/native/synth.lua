--- wsync's synthetic values (host/synth.h) as policy uses them: the values of
--- element i of tensor `name` at `version`, a pure function of the three, so
--- that a trainer rank, a check and a test compute the same bytes apart.
local ffi = require("ffi")
local C = require("wsync.native.ffi")

local M = {}

--- Writes `count` BF16 values of tensor `name` at `version`, elements
--- `first`.., into `bytes` of `memory` at byte `offset` (memory as in
--- wsync.native.copy). Returns true, or nil, message, code.
---@param memory any
---@param offset integer
---@param name string
---@param first integer
---@param count integer
---@param version integer
function M.fill(memory, offset, name, first, count, version)
  local pointer, size = require("wsync.native.copy").view(memory)
  if offset < 0 or offset + count * 2 > size then
    return nil, string.format("synthetic values of %s: %d bytes at %d exceed %d", name, count * 2, offset, size),
      "WS_EINVAL"
  end
  local status = C.ws_synth_fill(ffi.cast("char *", pointer) + offset, C.WS_DTYPE_BFLOAT16,
    C.ws_synth_seed(name, #name), first, count, version)
  if status ~= 0 then
    return nil, string.format("synthetic values of %s: %s", name, ffi.string(C.ws_error_detail())),
      ffi.string(C.ws_status_name(status))
  end
  return true
end

return M
