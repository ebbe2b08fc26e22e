--- Composable sums of tensor values (host/values.h): what a trainer rank's
--- elements add to each resident tensor's sum, and what a TP worker holds,
--- as 16-hex-digit strings that travel in control messages.
local ffi = require("ffi")
local bit = require("bit")
local C = require("wsync.native.ffi")

local M = {}

--- The seed of a tensor name.
---@param name string
---@return cdata uint64_t
function M.seed(name)
  return C.ws_values_seed(name, #name)
end

--- Adds the ops' terms (ops: tables with the fields of ws_values_op; seed a
--- uint64 cdata, slot 1-based) over `memory` (as wsync.native.copy takes it)
--- to `sums`, a uint64_t[slot_count] from M.slots. Returns true, or nil,
--- message, status name.
---@param memory any
---@param element_size integer
---@param ops table[]
---@param sums cdata
---@param slot_count integer
function M.add(memory, element_size, ops, sums, slot_count)
  local pointer, size = require("wsync.native.copy").view(memory)
  local count = #ops
  local array = ffi.new("ws_values_op[?]", math.max(count, 1))
  for index, op in ipairs(ops) do
    local out = array[index - 1]
    out.bias, out.first, out.rows, out.width, out.pitch = op.bias, op.first, op.rows, op.width, op.pitch
    out.lo, out.hi, out.index_first, out.index_pitch = op.lo, op.hi, op.index_first, op.index_pitch
    out.seed, out.slot = op.seed, op.slot - 1
  end
  local status = C.ws_values_sum(pointer, size, element_size, array, count, sums, slot_count)
  if status ~= 0 then
    return nil, ffi.string(C.ws_error_detail()), ffi.string(C.ws_status_name(status))
  end
  return true
end

--- `count` sums, all zero.
---@param count integer
---@return cdata
function M.slots(count)
  return ffi.new("uint64_t[?]", math.max(count, 1))
end

--- A sum as 16 lowercase hex digits.
---@param value cdata
---@return string
function M.hex(value)
  return bit.tohex(ffi.cast("uint64_t", value), 16)
end

--- The sum of hex sums (mod 2^64), as hex; nil for a string that is not 16
--- hex digits.
---@param list string[]
---@return string?
function M.add_hex(list)
  local total = ffi.new("uint64_t", 0)
  for _, text in ipairs(list) do
    if type(text) ~= "string" or not text:match("^" .. string.rep("%x", 16) .. "$") then
      return nil
    end
    local value = ffi.new("uint64_t", 0)
    for digit in text:gmatch(".") do
      value = value * 16 + tonumber(digit, 16)
    end
    total = total + value
  end
  return M.hex(total)
end

return M
