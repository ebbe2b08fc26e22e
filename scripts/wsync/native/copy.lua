--- Batched strided copies (host/copy.h) as policy uses them: the one builder
--- of copy-op batches. A batch is built once (a chunk's fill, a TP worker's
--- slice loads of a chunk, the expected values of a check) and run as often
--- as needed, each run one call into C whatever the number of ops.
---
--- Memory is anything with `pointer()` and `size()` (a wsync.native.shm
--- buffer) or a `{pointer = lightuserdata|cdata, size = bytes}` table.
--- Failures return nil, a message naming what failed, and the C status's
--- name (WS_EINVAL, ...), as every native module does.
local ffi = require("ffi")
local C = require("wsync.native.ffi")

local M = {}

---@class wsync.CopyBatch
---@field ops cdata     ws_copy_op[capacity]
---@field count integer ops added
local Batch = {}
Batch.__index = Batch

--- An empty batch with room for `capacity` ops (it grows when needed).
---@param capacity integer?
---@return wsync.CopyBatch
function M.batch(capacity)
  capacity = math.max(capacity or 16, 1)
  return setmetatable({ ops = ffi.new("ws_copy_op[?]", capacity), count = 0, capacity = capacity }, Batch)
end

--- Appends one op: `rows` rows of `width` bytes from `source_offset` (rows
--- `source_pitch` apart) to `target_offset` (rows `target_pitch` apart), read
--- from source `source` (0-based, for M.run_sources; default 0).
function Batch:add(target_offset, source_offset, rows, width, target_pitch, source_pitch, source)
  if self.count == self.capacity then
    local grown = ffi.new("ws_copy_op[?]", self.capacity * 2)
    ffi.copy(grown, self.ops, ffi.sizeof("ws_copy_op") * self.count)
    self.ops, self.capacity = grown, self.capacity * 2
  end
  local op = self.ops[self.count]
  op.target_offset, op.source_offset = target_offset, source_offset
  op.rows, op.width = rows, width
  op.target_pitch, op.source_pitch = target_pitch or width, source_pitch or width
  op.source = source or 0
  self.count = self.count + 1
end

--- The bytes one run of the batch moves into each target.
---@return integer
function Batch:bytes()
  return tonumber(C.ws_copy_bytes(self.ops, self.count))
end

-- The pointer and size of a memory.
local function view(memory)
  if type(memory) == "table" and memory.size ~= nil and type(memory.size) ~= "function" then
    return ffi.cast("void *", memory.pointer), memory.size
  end
  return ffi.cast("void *", memory:pointer()), memory:size()
end
M.view = view

-- nil, the message of the C failure with `what` before it, the status name.
local function failure(status, what)
  return nil, string.format("%s: %s", what, ffi.string(C.ws_error_detail())), ffi.string(C.ws_status_name(status))
end

--- Runs `batch` from `source` into `target`. Returns the bytes moved, or
--- nil, message, code (nothing is copied when an op is out of range).
---@param target any
---@param source any
---@param batch wsync.CopyBatch
---@param what string?  named in a failure ("TP worker 1, chunk 3")
function M.run(target, source, batch, what)
  local target_pointer, target_size = view(target)
  local source_pointer, source_size = view(source)
  local status = C.ws_copy_run(target_pointer, target_size, source_pointer, source_size, batch.ops, batch.count)
  if status ~= 0 then
    return failure(status, what or "copy")
  end
  return batch:bytes()
end

---@class wsync.CopyEnds
---@field pointers cdata  void *[n]
---@field sizes cdata     size_t[n]
---@field count integer

--- The pointer and size arrays of a list of memories, for M.run_sources:
--- built once per list (a rank's sources, a slot's targets) and kept.
---@param memories any[]
---@return wsync.CopyEnds
function M.ends(memories)
  local count = #memories
  local ends = { pointers = ffi.new("void *[?]", math.max(count, 1)), sizes = ffi.new("size_t[?]", math.max(count, 1)),
    count = count }
  for index, memory in ipairs(memories) do
    ends.pointers[index - 1], ends.sizes[index - 1] = view(memory)
  end
  return ends
end

--- Runs `batch`, whose ops pick one of `sources` each, into every memory of
--- `targets` (both from M.ends): one C call for a whole chunk. Returns the
--- bytes moved into all targets together, or nil, message, code.
---@param targets wsync.CopyEnds
---@param sources wsync.CopyEnds
---@param batch wsync.CopyBatch
---@param what string?
function M.run_sources(targets, sources, batch, what)
  local status = C.ws_copy_run_sources(targets.pointers, targets.sizes, targets.count, sources.pointers, sources.sizes,
    sources.count, batch.ops, batch.count)
  if status ~= 0 then
    return failure(status, what or "copy")
  end
  return targets.count * batch:bytes()
end

--- Faults in the pages of `memory` for writing now (a fresh allocation is
--- then as fast to fill as a device allocation). Returns true, or nil,
--- message, code.
function M.prefault(memory, what)
  local pointer, size = view(memory)
  local status = C.ws_copy_prefault(pointer, size)
  if status ~= 0 then
    return failure(status, what or "prefault")
  end
  return true
end

return M
