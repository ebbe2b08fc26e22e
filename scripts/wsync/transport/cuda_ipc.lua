--- The `cuda_ipc` transport, the cuda backend's data plane (shared/DESIGN.md
--- section 3): packed buffers from plain cudaMalloc on the rank's GPU,
--- exported once with cudaIpcGetMemHandle; the TP worker on the same GPU maps
--- each buffer once (cudaIpcOpenMemHandle) and keeps the mapping for as long
--- as its runtime lives. A chunk's fill is one batched copy kernel (one
--- rank) or one NCCL group of broadcasts straight into every rank's buffer
--- slot (several ranks: each root's dim-0 rows at their offset, uneven shards
--- included); a TP worker's load is one batched copy kernel from the mapped
--- buffer into resident device memory. Plans are made once per chunk and
--- launched on the process's own stream; completion is reported only after
--- the stream finished (a blocking wait in the driver, no spinning).
---
--- The interface is wsync.transport.shm's; where it needs the device, the
--- ranks' rows or NCCL, it takes a `context` ({device, world, rank,
--- nccl_id}). Descriptors are strings "<bytes>:<handle hex>".
---
--- Chunks ordered on the device (buffers.order = "device"): each rank also
--- holds a gate, a small buffer of two 32-bit words that its TP worker maps:
--- FILLED, which the rank's stream writes after each fill, and LOADED, which
--- the worker's stream writes after each load. A fill waits on the device
--- for LOADED to reach the previous chunk's number and a load for FILLED to
--- reach its own, so the device runs fill 1, load 1, fill 2, ... one after
--- the other with no host round trip between them (the two processes'
--- kernels are time-sliced, not run at once, when both are queued), and the
--- requests only queue the work. The gate lives in the rank's memory: a
--- rank whose worker died writes LOADED itself (M.release_gate) so that its
--- own stream never waits for a dead process.
local ffi = require("ffi")
local uv = require("luv")
local digest = require("wsync.native.digest")

local M = {}

--- The name a publication header gives this transport.
M.NAME = "cuda_ipc"

--- What it has beyond the interface (wsync.transport.CAPABILITIES): chunks
--- ordered on the device through gates, the direct path from a trainer's own
--- storage, synthetic values filled and checked on the device.
M.CAPABILITIES = { gates = true, direct = true, device_check = true }

local cuda_module, cuda_reason = nil, nil

-- wsync._cuda, or raises naming why this build or machine has none.
local function cuda()
  if cuda_module then
    return cuda_module
  end
  local ok, module = pcall(require, "wsync._cuda")
  if not ok or not module.built then
    cuda_reason = ok and "this wsync was built without CUDA" or tostring(module)
    require("wsync.errors").raise("TRANSPORT", "the cuda transport is not available: " .. cuda_reason)
  end
  cuda_module = module
  return module
end

local hex = require("wsync.native.digest").hex
local unhex = require("wsync.native.digest").unhex

-- A stream per device, made once per process.
local streams = {}

--- Makes `stream` the one this process's fills and loads on `device` queue
--- on (nil: a new one at the next use). For tests that play the device with
--- an object recording what is queued.
function M.set_stream(device, stream)
  streams[device] = stream
end
local function stream_of(device)
  if not streams[device] then
    local stream, message, code = cuda().stream(device)
    if not stream then
      return nil, message, code
    end
    streams[device] = stream
  end
  return streams[device]
end

--- Plans hold device addresses: made again when their memory moves.
M.BINDS_MEMORY = true

--- The copy plans' tile: the warps take 64 KiB tiles of a chunk's bytes in
--- turn (host/cuda_tiles.h), measured faster than each warp its own range
--- (tests/bench/RESULTS.md). $WSYNC_CUDA_COPY_TILE (bytes, a multiple of 512
--- up to 64 MiB; 0: the per-warp ranges) changes it where each plan is made
--- (tests/bench/cuda_publish.lua `SIZE@TILE`).
M.COPY_TILE = 64 * 1024

--- Runs of copies that continue one another contiguously (a packed expert
--- tensor into vLLM's fused expert weight at TP 1: 768 MiB for the 30B-A3B)
--- are joined, and those of at least this many bytes are copied by CUDA's own
--- device-to-device copy, the publication's floor, rather than by the kernel
--- (0.89 of it on the H200). $WSYNC_CUDA_COPY_BULK (bytes; 0: none) changes
--- it where each plan is made.
M.COPY_BULK = 16 * 1024 * 1024

-- A byte count from the environment, or nil, message, code.
local function bytes_from(name, default, valid, what)
  local value = os.getenv(name)
  if value == nil or value == "" then
    return default
  end
  local number = tonumber(value)
  if not number or not valid(number) then
    return nil, string.format("%s=%s is not %s", name, value, what), "WS_EINVAL"
  end
  return number
end

--- copy_plan's options for this process's plans, or nil, message, code.
function M.copy_options()
  local tile, message, code = bytes_from("WSYNC_CUDA_COPY_TILE", M.COPY_TILE, function(n)
    return n == 0 or (n % 512 == 0 and n >= 512 and n <= 64 * 1024 * 1024)
  end, "a number of bytes that is a multiple of 512 up to 64 MiB")
  if not tile then
    return nil, message, code
  end
  local bulk
  bulk, message, code = bytes_from("WSYNC_CUDA_COPY_BULK", M.COPY_BULK, function(n)
    return n >= 0 and n % 1 == 0 and n <= 2 ^ 53
  end, "a whole number of bytes")
  if not bulk then
    return nil, message, code
  end
  return { tile = tile ~= 0 and tile or nil, bulk = bulk ~= 0 and bulk or nil }
end

--- How the ranks' shards come together: NCCL broadcasts, every root's rows
--- into every rank's buffer (the host hands out every rank's rows).
M.GATHER = "broadcast"

--- What a fill reads from: the rank's memories themselves (buffers, or
--- `{pointer, size, device}` tables of storage allocated elsewhere).
---
--- A trainer's own storage registered through the agent API (a `{pointer,
--- size}` table, the pointer lightuserdata or cdata: a torch tensor's
--- data_ptr) becomes the region table the cuda binding reads, on `device`;
--- wsync's own buffers pass as they are.
---@param memories any[]
---@param device integer?
local function region_of(memory, device)
  if type(memory) == "table" and getmetatable(memory) == nil and memory.device == nil then
    local address = memory.pointer ~= nil and tonumber(ffi.cast("uintptr_t", memory.pointer)) or 0
    return { pointer = address, size = memory.size, device = device or 0 }
  end
  return memory
end

-- The device of a memory: a buffer's or mapping's, or a region table's field.
local function device_of(memory)
  if type(memory) == "table" and getmetatable(memory) == nil then
    return memory.device or 0
  end
  return memory:device()
end

function M.sources(memories, device)
  local regions = {}
  for index, memory in ipairs(memories) do
    regions[index] = region_of(memory, device)
  end
  return regions
end

---@class wsync.CudaOwn
---@field buffers userdata[]  this rank's packed buffers, by slot
---@field gate userdata?      the words chunks ordered on the device wait on
---@field device integer

--- Where the gate's words lie: the rank's stream writes FILLED, the TP
--- worker's LOADED (their own 128-byte lines).
M.GATE = { FILLED = 0, LOADED = 128, BYTES = 4096 }

--- Creates this rank's `count` packed buffers of `bytes` bytes on
--- `context.device`, and with `context.gate` its gate (both words 0).
--- Returns them, or nil, message, code.
function M.create(count, bytes, context)
  local device = context and context.device or 0
  local own = { buffers = {}, device = device }
  for slot = 1, count do
    local buffer, message, code = cuda().buffer(device, bytes)
    if not buffer then
      M.release(own)
      return nil, string.format("packed buffer %d (%d bytes) on GPU %d: %s", slot, bytes, device, message), code
    end
    own.buffers[slot] = buffer
  end
  if context and context.gate then
    local gate, message, code = cuda().buffer(device, M.GATE.BYTES) -- (zero-filled)
    if not gate then
      M.release(own)
      return nil, string.format("the gate of chunks ordered on the device, on GPU %d: %s", device, message), code
    end
    own.gate = gate
  end
  return own
end

--- The gate's descriptor (as a buffer's), or nil without one.
function M.gate_descriptor(own)
  if own.gate then
    return string.format("%d:%s", own.gate:size(), hex(assert(own.gate:export())))
  end
end

--- What the TP worker on the same GPU needs to map `own`'s buffers (by
--- slot): "<bytes>:<64-byte handle in hex>", each exported once.
function M.descriptors(own)
  local descriptors = {}
  for slot, buffer in ipairs(own.buffers) do
    local handle = assert(buffer:export())
    descriptors[slot] = string.format("%d:%s", buffer:size(), hex(handle))
  end
  return descriptors
end

---@class wsync.CudaTargets
---@field by_slot userdata[]   this rank's own buffers (the fill writes them)
---@field comm userdata?       the NCCL communicator of the ranks (world > 1)
---@field device integer

--- The targets of this rank's fills: its own buffers (a rank's GPU holds its
--- buffers only), and with several ranks the NCCL communicator they share
--- (`context.nccl_id` from the host, `context.world`). Returns them, or nil,
--- message, code.
function M.attach(own, descriptors, rank, context)
  local targets = { by_slot = own.buffers, device = own.device, gate = own.gate }
  local world = context and context.world or #descriptors
  if world > 1 then
    local nccl = require("wsync._nccl")
    if not (context and context.nccl_id) then
      return nil, "several trainer ranks on the cuda backend need the host's NCCL unique id", "WS_EINVAL"
    end
    local comm, message, code = nccl.init(own.device, world, rank, unhex(context.nccl_id))
    if not comm then
      return nil, "NCCL communicator: " .. tostring(message), code
    end
    targets.comm = comm
  end
  return targets
end

--- The NCCL unique id that the host hands to every rank (hex), made by one.
function M.nccl_id()
  local id, message, code = require("wsync._nccl").unique_id()
  if not id then
    return nil, message, code
  end
  return hex(id)
end

---@class wsync.CudaFillPlan
---@field copy userdata?        one rank: the batched copy
---@field broadcasts table[]?   several ranks: every root's rows, the same on every rank
---@field sources userdata[]|table[]
---@field slot integer

--- A chunk's fill, planned once: `spans` are this rank's pieces
--- (`{target_offset, source, source_offset, bytes}`, source 1-based into
--- `sources`); with several ranks `context.roots` gives every rank's pieces
--- (by rank, 1-based, the same shape; only the root's own have a source).
--- Returns the plan, or nil, message, code.
function M.plan_fill(targets, slot, sources, spans, context)
  local target = targets.by_slot[slot]
  if not target then
    return nil, string.format("buffer %s is not this rank's", tostring(slot)), "WS_EINVAL"
  end
  local plan = { slot = slot, sources = sources }
  if targets.comm then
    local broadcasts = {}
    for root_index, root_spans in ipairs(context.roots) do
      local own = root_index - 1 == targets.comm:rank()
      for _, span in ipairs(root_spans) do
        broadcasts[#broadcasts + 1] = { root = root_index - 1, target_offset = span.target_offset, bytes = span.bytes,
          source = own and span.source or nil, source_offset = own and span.source_offset or nil }
      end
    end
    plan.broadcasts = broadcasts
    return plan
  end
  local regions, ops = { target }, {}
  for index, memory in ipairs(sources) do
    regions[index + 1] = memory -- a buffer, a mapping, or {pointer, size, device}
  end
  for _, span in ipairs(spans) do
    ops[#ops + 1] = { target = 1, source = span.source + 1, target_offset = span.target_offset,
      source_offset = span.source_offset, width = span.bytes }
  end
  local options, message, code = M.copy_options()
  if not options then
    return nil, message, code
  end
  local copy
  copy, message, code = cuda().copy_plan(targets.device, regions, ops, options)
  if not copy then
    return nil, message, code
  end
  plan.copy = copy
  return plan
end

--- Forgets a fill plan (its device descriptors).
function M.close_plan(plan)
  if plan and plan.copy then
    plan.copy:close()
    plan.copy = nil
  end
  if plan and plan.fp8 then
    plan.fp8:close()
    plan.fp8 = nil
  end
end

-- Queues on `stream`, each step once the one before succeeded: a device wait
-- for a gate word (`steps.wait`: {memory, offset, value}; nil: none), the
-- work (`steps.run()`), the write of a gate word (`steps.signal`, the same
-- shape), then waits for the stream when `steps.settle`. Returns true, or
-- nil, message, code.
local function queue_gated(stream, steps)
  local ok, message, code = true, nil, nil
  if steps.wait then
    ok, message, code = stream:wait_value(unpack(steps.wait, 1, 3))
  end
  if ok then
    ok, message, code = steps.run()
  end
  if ok and steps.signal then
    ok, message, code = stream:write_value(unpack(steps.signal, 1, 3))
  end
  if ok and steps.settle then
    ok, message, code = stream:synchronize()
  end
  return ok, message, code
end

--- Runs a fill plan and waits until the device finished it. Returns the
--- bytes written into this rank's buffer and the seconds it took, or nil,
--- message, code. With `gate` ({after?, seq}: chunks ordered on the device)
--- it only queues the fill, behind a device wait for LOADED to reach
--- `after` (when given), and FILLED = `seq` after it; it returns at once (0 seconds), and
--- M.settle waits for it.
function M.fill(targets, slot, sources, plan, what, gate)
  local stream, message, code = stream_of(targets.device)
  if not stream then
    return nil, message, code
  end
  local started = uv.hrtime()
  if gate and not targets.gate then
    return nil, string.format("%s: ordered on the device, and this rank has no gate", what or "fill"), "WS_ESTATE"
  end
  local ok
  ok, message, code = queue_gated(stream, {
    -- (A publication's first fill waits for nothing.)
    wait = gate and gate.after ~= nil and { targets.gate, M.GATE.LOADED, gate.after } or nil,
    run = function()
      if plan.broadcasts then
        return targets.comm:fill(stream, targets.by_slot[slot], sources, plan.broadcasts)
      end
      return plan.copy:launch(stream)
    end,
    signal = gate and { targets.gate, M.GATE.FILLED, gate.seq },
    settle = not gate,
  })
  if not ok then
    return nil, string.format("%s: %s", what or "fill", tostring(message)), code
  end
  local bytes = 0
  if plan.copy then
    bytes = plan.copy:info().bytes
  else
    for _, broadcast in ipairs(plan.broadcasts) do
      bytes = bytes + broadcast.bytes
    end
  end
  return bytes, gate and 0 or (uv.hrtime() - started) / 1e9
end

--- Waits until the work queued on `device`'s stream finished (chunks ordered
--- on the device: every fill or load queued so far). Returns true, or nil,
--- message, code (a fill or load that failed on the device says so here).
function M.settle(device)
  local stream, message, code = stream_of(device or 0)
  if not stream then
    return nil, message, code
  end
  return stream:synchronize()
end

--- A rank's release of its own gate when its TP worker will not load again
--- (it died, or the publication failed): LOADED = `value`, written from the
--- host, so that every fill queued behind a wait for it runs; then waits for
--- the rank's stream. Returns true, or nil, message, code.
function M.release_gate(targets, value)
  if not (targets and targets.gate) then
    return true
  end
  local ok, message, code = targets.gate:write(M.GATE.LOADED, ffi.string(ffi.new("uint32_t[1]", value), 4))
  if not ok then
    return nil, "releasing the gate: " .. tostring(message), code
  end
  return M.settle(targets.device)
end

--- The direct path: exports the rank's own storage for the TP worker on the
--- same GPU to read, each memory once: wsync's cuda buffers, or storage
--- allocated elsewhere (a `{pointer, size}` table: a torch tensor's
--- data_ptr), whose whole cudaMalloc allocation is exported. Returns
--- descriptors like M.descriptors' and, by memory, where it starts in what its
--- descriptor maps (0 for a buffer); or nil, message, code.
function M.export_memories(memories, device)
  local descriptors, offsets = {}, {}
  -- (Memories in one allocation, as torch's caching allocator packs small
  -- tensors into one segment, share its descriptor: the TP worker maps it once.)
  local by_base = {}
  for index, memory in ipairs(memories) do
    local handle, size, offset, message, code
    if type(memory) == "userdata" and memory.export then
      handle, message, code = memory:export()
      size, offset = memory:size(), 0
    elseif type(memory) == "table" and getmetatable(memory) == nil then
      local region = region_of(memory, device)
      handle, size, offset = cuda().export_region(region)
      message, code = size, offset
      if handle then
        local base = region.pointer - offset
        by_base[base] = by_base[base] or { handle = handle, size = size }
        handle, size = by_base[base].handle, by_base[base].size
      end
    else
      return nil, string.format("memory %d is neither a cuda buffer nor {pointer, size} device storage", index),
        "WS_EINVAL"
    end
    if not handle then
      return nil, string.format("memory %d: %s", index, tostring(message)), code
    end
    descriptors[index] = string.format("%d:%s", size, hex(handle))
    offsets[index] = offset
  end
  return descriptors, offsets
end

--- Frees an agent's buffers, its gate and its communicator. Either may be
--- nil.
function M.release(own, targets)
  if targets and targets.comm then
    targets.comm:destroy()
    targets.comm = nil
  end
  for _, buffer in ipairs(own and own.buffers or {}) do
    buffer:close()
  end
  if own then
    own.buffers = {}
    if own.gate then
      own.gate:close()
      own.gate = nil
    end
  end
end

--- Maps the packed buffers a TP worker loads from, once each, on
--- `context.device`. Returns the mappings by slot, or nil, message, code.
function M.import(descriptors, context)
  local device = context and context.device or 0
  local imported = {}
  for slot, descriptor in ipairs(descriptors) do
    local bytes, handle = tostring(descriptor):match("^(%d+):(%x+)$")
    if not bytes or #handle ~= 128 then
      M.close_imported(imported)
      return nil, string.format("buffer %d: %q is not a cuda_ipc descriptor", slot, tostring(descriptor)), "WS_EINVAL"
    end
    local mapping, message, code = cuda().import(device, unhex(handle), tonumber(bytes))
    if not mapping then
      M.close_imported(imported)
      return nil, string.format("buffer %d: %s", slot, tostring(message)), code
    end
    imported[slot] = mapping
  end
  return imported
end

--- Maps a rank's gate (M.gate_descriptor) for its TP worker on
--- `context.device`. Returns the mapping, or nil, message, code.
function M.import_gate(descriptor, context)
  local imported, message, code = M.import({ descriptor }, context)
  if not imported then
    return nil, "the gate: " .. tostring(message), code
  end
  return imported[1]
end

--- Unmaps imported buffers (the last mapping of one closes its IPC handle).
M.close_imported = require("wsync.transport").close_imported

--- A chunk's loads for one TP worker, planned once: copies from `buffer`
--- (imported) into `resident`, `{target_offset, source_offset, rows, width,
--- target_pitch, source_pitch}`. With `buffer` a list of imported memories
--- (the direct path), each copy names its `source` (1-based) in it; with
--- `resident` a list of regions (`{pointer, size, device}`: another engine's
--- parameters), each copy names its `target` (1-based) in it. One kernel
--- launch whatever the number of copies. `transform` (the loader's quantized
--- slices, wsync.runtime.loader's transform_of; nil: none) is an FP8 plan in
--- the same regions, launched after the copies (host/cuda_plan.h). Returns
--- the plan, or nil, message, code.
function M.plan_load(resident, buffer, copies, transform)
  local targets = (type(resident) == "table" and resident[1] ~= nil) and resident or { resident }
  local regions = {}
  for index, region in ipairs(targets) do
    regions[index] = region
  end
  local first_source = #regions + 1
  local several = type(buffer) == "table" and buffer[1] ~= nil
  if several then
    for _, memory in ipairs(buffer) do
      regions[#regions + 1] = memory
    end
  else
    regions[first_source] = buffer
  end
  local ops = {}
  for index, c in ipairs(copies) do
    ops[index] = { target = c.target or 1, source = several and (first_source + c.source - 1) or first_source,
      target_offset = c.target_offset, source_offset = c.source_offset, rows = c.rows, width = c.width,
      target_pitch = c.target_pitch, source_pitch = c.source_pitch }
  end
  local device = device_of(targets[1])
  local options, message, code = M.copy_options()
  if not options then
    return nil, message, code
  end
  local plan
  plan, message, code = cuda().copy_plan(device, regions, ops, options)
  if not plan then
    return nil, message, code
  end
  local fp8_plan = nil
  if transform then
    local groups, quantized = {}, {}
    for index, group in ipairs(transform.groups) do
      groups[index] = { target = group.target or 1, scale_offset = group.scale_offset }
    end
    for index, op in ipairs(transform.ops) do
      quantized[index] = { group = op.group, target = op.target or 1,
        source = several and (first_source + op.source - 1) or first_source, target_offset = op.target_offset,
        source_offset = op.source_offset, rows = op.rows, columns = op.columns, target_pitch = op.target_pitch,
        source_pitch = op.source_pitch }
    end
    fp8_plan, message, code = cuda().fp8_plan(device, regions, groups, quantized)
    if not fp8_plan then
      plan:close()
      return nil, message, code
    end
  end
  return { copy = plan, fp8 = fp8_plan, resident = resident, buffer = buffer, device = device }
end

--- Runs a load plan and waits until the device finished it. Returns the
--- bytes moved and the seconds it took, or nil, message, code. With `gate`
--- ({memory = the rank's gate mapped, seq, last}: chunks ordered on the
--- device) it queues the load behind a device wait for FILLED to reach `seq`,
--- and LOADED = `seq` after it, and waits for the stream only when `last`
--- (the seconds are then the wait's).
function M.load(resident, buffer, plan, what, gate)
  if plan.resident ~= resident or plan.buffer ~= buffer then
    return nil, string.format("%s: the plan was made for other memory", what or "load"), "WS_ESTATE"
  end
  local stream, message, code = stream_of(plan.device)
  if not stream then
    return nil, message, code
  end
  local started = uv.hrtime()
  local ok
  ok, message, code = queue_gated(stream, {
    wait = gate and { gate.memory, M.GATE.FILLED, gate.seq },
    run = function()
      local launched, failure, failure_code = plan.copy:launch(stream)
      if launched and plan.fp8 then
        return plan.fp8:launch(stream)
      end
      return launched, failure, failure_code
    end,
    signal = gate and { gate.memory, M.GATE.LOADED, gate.seq },
    settle = not gate or gate.last,
  })
  if not ok then
    return nil, string.format("%s: %s", what or "load", tostring(message)), code
  end
  return plan.copy:info().bytes + (plan.fp8 and plan.fp8:info().bytes or 0), (uv.hrtime() - started) / 1e9
end

--- Allocates `bytes` of device memory on `context.device` (zero-filled).
function M.allocate(bytes, what, context)
  local device = context and context.device or 0
  local memory, message, code = cuda().buffer(device, math.max(bytes, 1))
  if not memory then
    return nil, string.format("cannot allocate %d bytes of %s on GPU %d: %s", bytes, what, device, message), code
  end
  return memory
end

-- The bytes of a host copy moved at a time.
local PIECE = 64 * 1024 * 1024

--- Copies all of device memory `memory` into host memory `host` (a
--- wsync.native.shm buffer of at least its size), or back with `back`, in
--- 64 MiB pieces. Returns true, or nil and why.
function M.copy_host(memory, host, back)
  local size = memory:size()
  for offset = 0, size - 1, PIECE do
    local length = math.min(PIECE, size - offset)
    if back then
      local ok, message = memory:write(offset, host:read(offset, length))
      if not ok then
        return nil, message
      end
    else
      local data, message = memory:read(offset, length)
      if not data then
        return nil, message
      end
      host:write(offset, data) -- (raises on misuse; returns nothing)
    end
  end
  return true
end

--- Fills `memory` with one byte of `pattern` (the dummy weights a runtime
--- starts with: on the device, a memset).
function M.fill_pattern(memory, pattern)
  local stream, message = stream_of(memory:device())
  if not stream then
    return nil, message
  end
  local ok
  ok, message = memory:fill(0, memory:size(), pattern:byte(1), stream)
  if ok then
    ok, message = stream:synchronize()
  end
  return ok, message
end

--- At most this many bytes are read back to host memory for the values
--- check (wsync.plan.values): it is a check for tests and small models.
M.HOST_COPY_MAX = 2 ^ 30

--- `memory` (a buffer, a mapping, or a trainer's `{pointer, size}` storage on
--- `device`) read back into host memory, as wsync.native.copy takes memory
--- (`{pointer, size, keep}`), for the values check. Returns it, or nil,
--- message, code.
function M.host_copy(memory, device)
  memory = region_of(memory, device)
  local size = type(memory) == "table" and getmetatable(memory) == nil and memory.size or memory:size()
  if size > M.HOST_COPY_MAX then
    return nil, string.format("the values check reads device memory back to the host, at most %d bytes per memory; "
      .. "this one has %d (use verify = true, on the device)", M.HOST_COPY_MAX, size), "WS_EINVAL"
  end
  local data, message, code = cuda().read(memory, 0, size)
  if not data then
    return nil, message, code
  end
  return { pointer = ffi.cast("const char *", data), size = #data, keep = data }
end

--- The SHA-256 of `bytes` of `memory` from `offset` (read back to the
--- host: for checks of small models).
function M.checksum(memory, offset, bytes)
  local data, message = memory:read(offset, bytes)
  if not data then
    return nil, message
  end
  return digest.sha256_hex(data)
end

-- Runs a synthetic plan of `ops` over the buffers `regions` (of one device)
-- once: `check` (the result) or a fill (true), waited for on the process's
-- stream.
local function synthetic(regions, ops, version, check)
  local device = regions[1]:device()
  local stream, message, code = stream_of(device)
  if not stream then
    return nil, message, code
  end
  local plan
  plan, message, code = cuda().synth_plan(device, regions, ops)
  if not plan then
    return nil, message, code
  end
  local ok
  if check then
    ok, message, code = plan:check(version, stream)
    if ok then
      ok, message, code = plan:result() -- (waits for the check)
    end
  else
    ok, message, code = plan:fill(version, stream)
    if ok then
      ok, message, code = stream:synchronize()
    end
  end
  plan:close()
  if not ok then
    return nil, message, code
  end
  return ok
end

--- Checks `memory` against wsync's synthetic values at `version` on the
--- device: `ops` as wsync._cuda.synth_plan takes them (region 1 is
--- `memory`). Returns {mismatches, op, element}, or nil, message, code.
function M.check_synthetic(memory, ops, version)
  return synthetic({ memory }, ops, version, true)
end

--- Writes wsync's synthetic values at `version` into the buffers `memories`
--- (a list of buffers of one device; an op's region is its index in it) on
--- the device, and waits for them. Returns true, or nil, message, code.
function M.fill_synthetic(memories, ops, version)
  return synthetic(memories, ops, version, false)
end

--- Nothing of a cuda buffer outlives the processes that hold it: no names
--- to remove. (Returns the same as wsync.transport.shm.remove_leftovers.)
function M.remove_leftovers()
  return {}, {}
end

return M
