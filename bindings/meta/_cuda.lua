---@meta wsync._cuda
-- LuaCATS stubs for `wsync._cuda` (bindings/l_cuda.c): the cuda backend's
-- device buffers, IPC mappings, streams, events, copy plans and synthetic
-- plans. Not loaded at run time; read by the Lua language server.
-- tests/bindings/meta_spec.lua checks the stubs.
--
-- Misuse raises; runtime failure returns nil, message, CODE (ENODEV without a
-- driver or device, ECUDA with CUDA's own error name, EINVAL for an op or a
-- range that does not fit, naming the op and region counted from 0 as the
-- core does). Every object is closed with close(); __gc is a safety net.

---A range of device memory: a buffer, a mapping, or memory someone else
---allocated (a trainer's tensor), as {pointer, size, device}.
---@alias wsync.cuda.RegionLike wsync.cuda.Buffer|wsync.cuda.Mapping|wsync.cuda.Region

---@class wsync.cuda.Region
---@field pointer number   device address (exact below 2^53)
---@field size number      bytes
---@field device integer   CUDA device index

---One strided copy: regions are indices (from 1) into the plan's region list.
---@class wsync.cuda.CopyOp
---@field target integer
---@field source integer
---@field target_offset integer?  default 0
---@field source_offset integer?  default 0
---@field rows integer?           default 1
---@field width integer           bytes per row
---@field target_pitch integer?   default width
---@field source_pitch integer?   default width

---Synthetic elements of tensor `name` (or `seed`): row k at offset + k * pitch
---holds tensor elements first + k * element_pitch onwards.
---@class wsync.cuda.Fp8Group
---@field target integer        index (from 1) into the plan's region list: where the group's float32 scale lies
---@field scale_offset integer  bytes

---@class wsync.cuda.Fp8Op
---@field group integer           index (from 1) into the plan's groups
---@field target integer          region (from 1) of the float8 elements
---@field source integer          region (from 1) of the bfloat16 elements
---@field target_offset integer?  bytes, default 0
---@field source_offset integer?  bytes, default 0
---@field rows integer?           default 1
---@field columns integer         elements per row
---@field target_pitch integer?   bytes between rows, default columns
---@field source_pitch integer?   bytes between rows, default 2 x columns

---@class wsync.cuda.SynthOp
---@field region integer          index (from 1) into the plan's region list
---@field name string?            tensor name (its seed: ws_synth_seed)
---@field seed number?            the seed itself, when no name
---@field dtype "bfloat16"|"float32"|nil  default "bfloat16"
---@field offset integer?         bytes, default 0
---@field rows integer?           default 1
---@field elements integer        elements per row
---@field pitch integer?          bytes between rows, default elements x size
---@field first integer?          tensor element of row 0, default 0
---@field element_pitch integer?  tensor elements between rows, default elements

---@class wsync.cuda.PlanInfo
---@field ops number
---@field pieces number        descriptors on the device
---@field warps number         warps one launch spreads them over
---@field blocks number        thread blocks of one launch
---@field bytes number         bytes one launch moves
---@field device_bytes number  device memory the plan holds
---@field tile number          bytes per tile of a tiled copy plan (0: per-warp ranges)

---@class wsync.cuda.Counters
---@field allocations number     cudaMalloc calls (buffers, plans)
---@field frees number
---@field live_bytes number      allocated and not freed
---@field exports number         cudaIpcGetMemHandle calls
---@field ipc_opens number       cudaIpcOpenMemHandle calls
---@field ipc_closes number      cudaIpcCloseMemHandle calls
---@field mappings_reused number imports answered by an open mapping
---@field live_mappings number
---@field launches number        kernel launches

---@class wsync._cuda
---@field built boolean  the binary carries the cuda backend (a GPU may still be absent)
local cuda = {}

---@param device integer
---@param bytes integer
---@return wsync.cuda.Buffer|nil buffer, string? message, string? code
function cuda.buffer(device, bytes) end

---@param device integer
---@param handle string  the 64-byte cudaIpcMemHandle_t from buffer:export()
---@param bytes integer  the exported buffer's size (checked where the driver tells)
---@return wsync.cuda.Mapping|nil mapping, string? message, string? code
function cuda.import(device, handle, bytes) end

--- Exports the cudaMalloc allocation that holds `region` (memory allocated
--- some other way, a torch tensor's storage): its handle, the allocation's
--- size and where the region starts in it.
---@param region wsync.cuda.Region
---@return string|nil handle, number|string allocation_size_or_message, number|string offset_or_code
function cuda.export_region(region) end

---@param device integer
---@return wsync.cuda.Stream|nil stream, string? message, string? code
function cuda.stream(device) end

---@param device integer
---@param timing boolean?  measurable with event:elapsed
---@return wsync.cuda.Event|nil event, string? message, string? code
function cuda.event(device, timing) end

---@param device integer
---@param regions wsync.cuda.RegionLike[]
---@param ops wsync.cuda.CopyOp[]|string  tables, or packed ws_cuda_copy_op records (regions from 0)
---@param options {tile: integer?, bulk: integer?}?  tile: the tiled layout, the warps taking tiles of that many bytes in turn; bulk: runs of ops that continue one another contiguously, joined, and copied by CUDA's own copy from that many bytes on
---@return wsync.cuda.CopyPlan|nil plan, string? message, string? code
function cuda.copy_plan(device, regions, ops, options) end

---@param device integer
---@param regions wsync.cuda.RegionLike[]
---@param ops wsync.cuda.SynthOp[]|string  tables, or packed ws_cuda_synth_op records (regions from 0)
---@return wsync.cuda.SynthPlan|nil plan, string? message, string? code
function cuda.synth_plan(device, regions, ops) end

---A load's FP8 transform (host/cuda_plan.h): every group's scale over its
---ops' bfloat16 elements, then the elements quantized in place.
---@param device integer
---@param regions wsync.cuda.RegionLike[]
---@param groups wsync.cuda.Fp8Group[]|string  tables, or packed ws_fp8_group records (regions from 0)
---@param ops wsync.cuda.Fp8Op[]|string  tables, or packed ws_fp8_op records (groups and regions from 0)
---@return wsync.cuda.Fp8Plan|nil plan, string? message, string? code
function cuda.fp8_plan(device, regions, groups, ops) end

---Copies host bytes in, ordered on the stream, and returns once they are there.
---@param region wsync.cuda.RegionLike
---@param offset integer
---@param bytes string
---@param stream wsync.cuda.Stream?
---@return true|nil ok, string? message, string? code
function cuda.write(region, offset, bytes, stream) end

---Copies bytes out, ordered on the stream, and returns once they are here.
---@param region wsync.cuda.RegionLike
---@param offset integer
---@param length integer
---@param stream wsync.cuda.Stream?
---@return string|nil bytes, string? message, string? code
function cuda.read(region, offset, length, stream) end

---Queues a byte fill on the stream.
---@param region wsync.cuda.RegionLike
---@param offset integer
---@param length integer
---@param value integer  0..255
---@param stream wsync.cuda.Stream?
---@return true|nil ok, string? message, string? code
function cuda.fill(region, offset, length, value, stream) end

---Queues one cudaMemcpyAsync device to device (the copy engine's floor).
---@param target wsync.cuda.RegionLike
---@param target_offset integer
---@param source wsync.cuda.RegionLike
---@param source_offset integer
---@param length integer
---@param stream wsync.cuda.Stream?
---@return true|nil ok, string? message, string? code
function cuda.memcpy(target, target_offset, source, source_offset, length, stream) end

---@return wsync.cuda.Counters
function cuda.counters() end

---What a buffer and a mapping both are: device memory that reads, writes and fills.
---@class wsync.cuda.Memory
local Memory = {}
---@return wsync.cuda.Region
function Memory:region() end
---@return number
function Memory:pointer() end
---@return number
function Memory:size() end
---@return integer
function Memory:device() end
---@param offset integer
---@param length integer
---@param stream wsync.cuda.Stream?
---@return string|nil bytes, string? message, string? code
function Memory:read(offset, length, stream) end
---@param offset integer
---@param bytes string
---@param stream wsync.cuda.Stream?
---@return true|nil ok, string? message, string? code
function Memory:write(offset, bytes, stream) end
---@param offset integer
---@param length integer
---@param value integer  0..255
---@param stream wsync.cuda.Stream?
---@return true|nil ok, string? message, string? code
function Memory:fill(offset, length, value, stream) end

---@class wsync.cuda.Buffer: wsync.cuda.Memory
local Buffer = {}
---@return string|nil handle, string? message, string? code  64 bytes, exported once
function Buffer:export() end
---@return true|nil ok, string? message, string? code
function Buffer:close() end

---@class wsync.cuda.Mapping: wsync.cuda.Memory
local Mapping = {}
---@return true|nil ok, string? message, string? code  the last mapping of a buffer closes the IPC handle
function Mapping:close() end

---@class wsync.cuda.Stream
local Stream = {}
---Waits for the queued work, blocked in the driver (no spinning).
---@return true|nil ok, string? message, string? code
function Stream:synchronize() end
---Queues a wait of the device until the 32-bit word at `offset` reaches `value` (cyclically).
---@param region wsync.cuda.RegionLike
---@param offset integer
---@param value integer
---@return true|nil ok, string? message, string? code
function Stream:wait_value(region, offset, value) end
---Queues a write of `value` to the 32-bit word at `offset`, after the work queued before it.
---@param region wsync.cuda.RegionLike
---@param offset integer
---@param value integer
---@return true|nil ok, string? message, string? code
function Stream:write_value(region, offset, value) end
---@return integer
function Stream:device() end
---@return true|nil ok, string? message, string? code
function Stream:close() end

---@class wsync.cuda.Event
local Event = {}
---@param stream wsync.cuda.Stream?
---@return true|nil ok, string? message, string? code
function Event:record(stream) end
---@return boolean|nil done, string? message, string? code
function Event:query() end
---@return true|nil ok, string? message, string? code
function Event:synchronize() end
---@param start wsync.cuda.Event
---@return number|nil milliseconds, string? message, string? code  from start to this event
function Event:elapsed(start) end
---@return true|nil ok, string? message, string? code
function Event:close() end

---What a copy, synthetic and FP8 plan all are: ops held on the device, described alike.
---@class wsync.cuda.Plan
local Plan = {}
---@return wsync.cuda.PlanInfo
function Plan:info() end
---@return true|nil ok, string? message, string? code
function Plan:close() end

---@class wsync.cuda.CopyPlan: wsync.cuda.Plan
local CopyPlan = {}
---Queues the plan's one kernel launch.
---@param stream wsync.cuda.Stream?
---@return true|nil ok, string? message, string? code
function CopyPlan:launch(stream) end

---@class wsync.cuda.SynthResult
---@field mismatches number
---@field op number?       the first mismatching op (from 1)
---@field element number?  its tensor element index

---@class wsync.cuda.SynthPlan: wsync.cuda.Plan
local SynthPlan = {}
---@param version integer
---@param stream wsync.cuda.Stream?
---@return true|nil ok, string? message, string? code
function SynthPlan:fill(version, stream) end
---@param version integer
---@param stream wsync.cuda.Stream?
---@return true|nil ok, string? message, string? code
function SynthPlan:check(version, stream) end
---Waits for the last check (no spinning) and returns its outcome.
---@return wsync.cuda.SynthResult|nil result, string? message, string? code
function SynthPlan:result() end

---@class wsync.cuda.Fp8Plan: wsync.cuda.Plan
local Fp8Plan = {}
---Queues the transform: the groups' amax, then their scales and elements.
---@param stream wsync.cuda.Stream?
---@return true|nil ok, string? message, string? code
function Fp8Plan:launch(stream) end
