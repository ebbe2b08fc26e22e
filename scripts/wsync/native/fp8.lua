--- FP8 quantization of bfloat16 weights (host/fp8.h) as policy uses it: the
--- one builder of a transform (groups, each with one float32 scale, and the
--- strided pieces quantized under it), run on the host in one C call, and
--- the scalar reference functions the specs check by hand.
---
--- A transform is built once per chunk (a TP worker's quantized slices of
--- it) and run as often as needed. Memory is what wsync.native.copy takes.
local ffi = require("ffi")
local C = require("wsync.native.ffi")
local copy = require("wsync.native.copy")

local M = {}

--- The largest finite float8_e4m3fn.
M.MAX = 448

---@class wsync.Fp8Transform
---@field groups cdata  ws_fp8_group[group_capacity]
---@field ops cdata     ws_fp8_op[capacity]
---@field group_count integer
---@field count integer
local Transform = {}
Transform.__index = Transform

--- An empty transform with room for `capacity` ops and `group_capacity`
--- groups (both grow when needed).
---@param capacity integer?
---@param group_capacity integer?
---@return wsync.Fp8Transform
function M.transform(capacity, group_capacity)
  capacity, group_capacity = math.max(capacity or 16, 1), math.max(group_capacity or 4, 1)
  return setmetatable({ ops = ffi.new("ws_fp8_op[?]", capacity), groups = ffi.new("ws_fp8_group[?]", group_capacity),
    count = 0, group_count = 0, capacity = capacity, group_capacity = group_capacity }, Transform)
end

-- `array` (of `used` entries, `capacity` of room) of `ctype`, with room for
-- one more: the same or a copy twice its size.
local function grown(array, used, capacity, ctype)
  if used < capacity then
    return array, capacity
  end
  local bigger = ffi.new(ctype .. "[?]", capacity * 2)
  ffi.copy(bigger, array, ffi.sizeof(ctype) * used)
  return bigger, capacity * 2
end

--- Appends a group whose float32 scale lies at byte `scale_offset` of target
--- `target` (0-based). Returns its index (0-based), for M.Transform.add.
---@param target integer
---@param scale_offset integer
---@return integer
function Transform:add_group(target, scale_offset)
  self.groups, self.group_capacity = grown(self.groups, self.group_count, self.group_capacity, "ws_fp8_group")
  local group = self.groups[self.group_count]
  group.target, group.scale_offset = target, scale_offset
  self.group_count = self.group_count + 1
  return self.group_count - 1
end

--- Appends one piece of group `group` (0-based): `rows` rows of `columns`
--- bfloat16 elements from byte `source_offset` of source `source` (rows
--- `source_pitch` bytes apart; default 2 x columns) to float8 bytes at
--- `target_offset` of target `target` (rows `target_pitch` apart; default
--- columns). `piece` is `{group, target, source, target_offset,
--- source_offset, rows, columns, target_pitch?, source_pitch?}`.
---@param piece table
function Transform:add(piece)
  self.ops, self.capacity = grown(self.ops, self.count, self.capacity, "ws_fp8_op")
  local op = self.ops[self.count]
  op.group, op.target, op.source = piece.group, piece.target or 0, piece.source or 0
  op.target_offset, op.source_offset = piece.target_offset, piece.source_offset
  op.rows, op.columns = piece.rows, piece.columns
  op.target_pitch = piece.target_pitch or piece.columns
  op.source_pitch = piece.source_pitch or 2 * piece.columns
  self.count = self.count + 1
end

--- The bytes one run writes: every float8 element and every scale.
---@return integer
function Transform:bytes()
  local bytes = 4 * self.group_count
  for i = 0, self.count - 1 do
    bytes = bytes + tonumber(self.ops[i].rows * self.ops[i].columns)
  end
  return bytes
end

--- The transform's groups and ops as Lua tables (0-based indices, as added):
--- `{groups = {{target, scale_offset}}, ops = {{group, target, source,
--- target_offset, source_offset, rows, columns, target_pitch,
--- source_pitch}}}`, for a plan on the device.
function Transform:tables()
  local groups, ops = {}, {}
  for g = 0, self.group_count - 1 do
    groups[g + 1] = { target = tonumber(self.groups[g].target), scale_offset = tonumber(self.groups[g].scale_offset) }
  end
  for i = 0, self.count - 1 do
    local op = self.ops[i]
    ops[i + 1] = { group = tonumber(op.group), target = tonumber(op.target), source = tonumber(op.source),
      target_offset = tonumber(op.target_offset), source_offset = tonumber(op.source_offset),
      rows = tonumber(op.rows), columns = tonumber(op.columns), target_pitch = tonumber(op.target_pitch),
      source_pitch = tonumber(op.source_pitch) }
  end
  return { groups = groups, ops = ops }
end

--- Runs `transform` from `sources` into `targets` (each a memory, or a list
--- of memories that the ops' 0-based indices pick): every group's scale,
--- then its float8 elements. Returns the bytes written, or nil, message,
--- code (nothing is written when an op or a group is out of range).
---@param targets any
---@param sources any
---@param transform wsync.Fp8Transform
---@param what string?
function M.run(targets, sources, transform, what)
  local function ends(memories)
    return copy.ends((type(memories) == "table" and memories[1] ~= nil) and memories or { memories })
  end
  local to, from = ends(targets), ends(sources)
  local status = C.ws_fp8_run(to.pointers, to.sizes, to.count, ffi.cast("const void *const *", from.pointers),
    from.sizes, from.count, transform.groups, transform.group_count, transform.ops, transform.count)
  if status ~= 0 then
    return nil, string.format("%s: %s", what or "fp8", ffi.string(C.ws_error_detail())),
      ffi.string(C.ws_status_name(status))
  end
  return transform:bytes()
end

--- The float8_e4m3fn bits of `value` (round to nearest even, saturated).
---@param value number
---@return integer
function M.from_float(value)
  return C.ws_fp8_e4m3_from_float(value)
end

--- The value of float8_e4m3fn bits.
---@param bits integer
---@return number
function M.to_float(bits)
  return C.ws_fp8_e4m3_to_float(bits)
end

--- The float32 scale of a group whose largest magnitude is `amax`.
---@param amax number
---@return number
function M.scale(amax)
  return C.ws_fp8_scale(amax)
end

--- One element's float8 bits under `scale`, as vLLM's kernel writes them.
---@param value number
---@param scale number
---@return integer
function M.quantize(value, scale)
  return C.ws_fp8_quantize(value, scale)
end

return M
