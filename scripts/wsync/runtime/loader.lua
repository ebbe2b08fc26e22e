--- The weight loader of one TP rank: the transfer state machine behind the
--- weight commands, whatever memory it writes into. It answers init_weights,
--- start_update, load_chunk and finish_update (the receipt), and the checks
--- of what they left (resident_checksums, resident_check, resident_values,
--- weights_digest); it owns the imported packed buffers, the rank's gate, the
--- chunks' load plans and their parts of the manifest.
---
--- Weight transfer: the packed buffers are imported once per init_weights;
--- each chunk's loads and its part of the manifest are planned at its first
--- load (when its tensor metadata comes) and kept, so a publication runs one
--- transport call and one digest update per chunk.
---
--- Memory: the loader holds no resident memory of its own. It writes into a
--- memory object (wsync.ResidentMemory, M.MEMORY) that says where the loader
--- plan's resident tensors lie and whether they can be written now. Two
--- implement it: the reference TP worker's own memory (wsync.runtime.worker:
--- allocated from the transport, slept and woken, one region in the plan's
--- layout) and an engine's parameters (wsync.runtime.engine_worker: vLLM's,
--- bound by address, one region per resident tensor).
local uv = require("luv")
local errors = require("wsync.errors")
local chunk_plans_module = require("wsync.transport.chunk_plans")
local manifest_module = require("wsync.native.manifest")
local plan_module = require("wsync.plan")
local shm = require("wsync.native.shm")
local transport_module = require("wsync.transport")
local util = require("wsync.util")

local M = {}

--- Refuses a command in the state it finds (STATE_REFUSED, not fatal: the
--- worker is as it was).
---@param message string
function M.refuse(message)
  errors.raise("STATE_REFUSED", message)
end

--- Fails a command fatally with `code` (the runtime is destroyed).
---@param code string
---@param message string
function M.fatal(code, message)
  errors.raise(code, message, { fatal = true })
end

local refuse, fatal = M.refuse, M.fatal

--- Host memory of `bytes` for a copy of resident weights (`what` names it),
--- or a fatal OUT_OF_MEMORY.
---@param bytes integer
---@param what string
---@return userdata
function M.allocate_host(bytes, what)
  local buffer, message = shm.anonymous(math.max(bytes, 1))
  if not buffer then
    fatal("OUT_OF_MEMORY", string.format("cannot allocate %d bytes of %s: %s", bytes, what, message))
  end
  return buffer
end

---@class wsync.ResidentMemory
--- Where a loader writes: the resident tensors of its rank's loader plan.
--- Its methods raise as the command that calls them would (M.refuse,
--- M.fatal).
---@field bind fun(self: wsync.ResidentMemory, plan: table, payload: table)
---   init_weights: holds the residents of the new loader `plan` (sized to it,
---   or found in the command's `payload`)
---@field prepare fun(self: wsync.ResidentMemory, payload: table)
---   start_update: makes the residents ready to be written, or refuses
---@field place fun(self: wsync.ResidentMemory, slice: table, index: integer): integer?, integer
---   where a copy of the plan (`{resident, dst, ...}`, its resident tensor
---   the plan's `index`-th) lands: the index of its memory in resident()
---   (nil: resident() is one memory) and the offset there
---@field resident fun(self: wsync.ResidentMemory): any
---   what the transport loads into (one memory, or a list of regions); the
---   same value until the memory moves (then the chunks are planned again
---   where a plan holds addresses); nil while there is none
---@field flat fun(self: wsync.ResidentMemory): any, string?
---   the residents as one memory in the plan's layout, which the transport
---   reads back (checksums, the device check, the digest); nil while there is
---   none, with the reason when this memory is never read back
---@field host_copy fun(self: wsync.ResidentMemory, plan: table): any, string?
---   the residents in host memory in the plan's layout (the values check), or
---   nil and why; given back with close_host_copy
---@field close_host_copy fun(self: wsync.ResidentMemory, copy: any)
---@field state fun(self: wsync.ResidentMemory): {weights: string, kv_cache: string}
---@field usage fun(self: wsync.ResidentMemory): {device_bytes: integer, host_bytes: integer}
---@field release fun(self: wsync.ResidentMemory)
---   frees or forgets every resident memory (the loader releases all)

--- The methods of a memory (wsync.ResidentMemory), by name.
M.MEMORY = { "bind", "prepare", "place", "resident", "flat", "host_copy", "close_host_copy", "state", "usage",
  "release" }

---@class wsync.Loader
local Loader = {}
Loader.__index = Loader
M.Loader = Loader -- its methods, for tests

--- The commands a loader answers (each a method of the same name, taking the
--- command's payload).
M.COMMANDS = { "init_weights", "start_update", "load_chunk", "finish_update", "resident_checksums",
  "resident_check", "resident_values", "weights_digest" }

---@class wsync.LoaderOptions
---@field rank integer
---@field world integer
---@field device {backend: string, index: integer, uuid: string, name: string?}
---@field transport table  the backend's transport (wsync.transport)
---@field context table  what the transport needs beyond the arguments: {device}
---@field memory wsync.ResidentMemory

--- A loader of TP rank `rank` of `world` over `memory`, nothing imported: the
--- fields of `options`, and its own state.
--- Raises (misuse) when `memory` lacks a method of M.MEMORY.
---@param options wsync.LoaderOptions
---@return wsync.Loader
function M.new(options)
  for _, name in ipairs(M.MEMORY) do
    if type(options.memory[name]) ~= "function" then
      error("a loader's memory lacks " .. name, 2)
    end
  end
  return setmetatable(util.merged(options, { imported = {}, load_plans = chunk_plans_module.new(options.transport) }),
    Loader)
end

--- This rank as the info command answers it: rank, world, pid, device, the
--- memory's state and usage.
function Loader:info()
  return {
    rank = self.rank,
    world = self.world,
    pid = uv.os_getpid(),
    device = self.device,
    state = self.memory:state(),
    memory = self.memory:usage(),
  }
end

--- Whether a weight update is in progress (start_update to finish_update).
function Loader:updating()
  return self.update ~= nil
end

--- How many packed buffers are mapped.
function Loader:mapped_count()
  return #self.imported
end

--- The imported packed buffer of slot `slot`, or a fatal NO_BUFFER naming
--- `command`.
---@param slot any
---@param command string
function Loader:buffer(slot, command)
  local memory = self.imported[slot]
  if not memory then
    fatal("NO_BUFFER", string.format("%s names buffer %s; %d are mapped", command, tostring(slot), #self.imported))
  end
  return memory
end

--- init_weights{family, config, tp, transport, buffers, gate?,
--- quantization?}: once per runtime (and again only with a new session's
--- buffers). Computes this rank's loader plan (under the rollout's
--- quantization: the resident tensors the engine holds), has the memory hold
--- its residents, and imports the rank's packed buffers once; the mappings
--- are kept and reused.
function Loader:init_weights(payload)
  local family = plan_module.family(payload.family)
  local config = family.config(payload.config)
  if payload.tp ~= self.world then
    fatal("TOPOLOGY", string.format("init_weights for TP %d sent to a worker of TP %d", payload.tp, self.world))
  end
  if payload.transport ~= self.transport.NAME then
    fatal("TRANSPORT", string.format("init_weights for transport %s; TP worker %d moves weights over %s",
      tostring(payload.transport), self.rank, self.transport.NAME))
  end
  local plan = family.loader_plan(config, self.world, self.rank, payload.quantization)
  self.transport.close_imported(self.imported)
  self.imported = {}
  self:_close_gate()
  local imported, message = self.transport.import(payload.buffers, self.context)
  if not imported then
    fatal("IMPORT_FAILED", string.format("TP worker %d cannot map its rank's packed buffers: %s", self.rank, message))
  end
  self.imported = imported
  if payload.gate ~= nil then
    -- (Chunks ordered on the device: the rank's gate, wsync.transport.cuda_ipc.)
    if not transport_module.can(self.transport, "gates") then
      fatal("TRANSPORT", string.format("TP worker %d: the %s transport cannot order chunks on the device", self.rank,
        self.transport.NAME))
    end
    self.gate, message = self.transport.import_gate(payload.gate, self.context)
    if not self.gate then
      fatal("IMPORT_FAILED", string.format("TP worker %d cannot map its rank's gate: %s", self.rank, message))
    end
  end
  self.plan = plan
  self.load_plans:clear()
  -- Resident tensors by index, for the receipts' count of those filled.
  self.resident_index = {}
  for index, tensor in ipairs(plan.tensors) do
    self.resident_index[tensor.name] = index
  end
  self.memory:bind(plan, payload)
  return { resident_tensors = #plan.tensors, resident_bytes = plan.bytes, buffers = #payload.buffers,
    ordered = self.gate ~= nil }
end

-- Unmaps the rank's gate, after waiting for the loads queued behind it.
function Loader:_close_gate()
  if self.gate then
    if self.gate_pending then
      self.transport.settle(self.context.device)
      self.gate_pending = nil
    end
    self.gate:close()
    self.gate = nil
  end
end

--- start_update{header, ...}: enters update mode; no generation until
--- finish. The memory makes its residents ready (or refuses) from the rest
--- of the payload.
function Loader:start_update(payload)
  if not self.plan then
    fatal("NOT_INITIALIZED", "start_update before init_weights")
  end
  self.memory:prepare(payload)
  self.epoch = (self.epoch or 0) + 1
  self.filled = self.filled or {}
  -- `loaded`: the chunks loaded, in order; the receipt's manifest is the
  -- manifest of their segments (wsync.native.manifest.digest_cache).
  self.update = { header = payload.header, loaded = {}, tensors = 0, bytes = 0, touched = 0, epoch = self.epoch }
  return {}
end

-- Plans chunk `k`'s loads from its tensor metadata (`{name, dtype, shape,
-- offset, bytes}`, where each canonical tensor lies in the buffer): this TP
-- rank's slice copies of each, checked against the metadata, the chunk's part
-- of the manifest, and the resident tensors it fills (each once). Slices the
-- loader plan quantizes (under fp8: a `group` each) make the chunk's
-- transform instead (M.transform_of).
function Loader:_plan_chunk(k, tensors)
  local copies_by_name = self.plan.copies
  local copies, residents, checks, seen, quantized = {}, {}, {}, {}, {}
  local segment, message = manifest_module.segment()
  if not segment then
    fatal("MANIFEST", string.format("TP worker %d: %s", self.rank, tostring(message)))
  end
  manifest_module.fill_segment(segment, function()
    for _, tensor in ipairs(tensors) do
      if type(tensor) ~= "table" or type(tensor.name) ~= "string" or type(tensor.offset) ~= "number"
          or type(tensor.bytes) ~= "number" then
        fatal("BAD_METADATA", string.format("chunk %s: a tensor is not {name, dtype, shape, offset, bytes}",
          tostring(k)))
      end
      local slices = copies_by_name[tensor.name]
      if not slices then
        fatal("UNKNOWN_TENSOR", string.format("TP worker %d has no loader plan for %s", self.rank, tensor.name))
      end
      local added, reason = segment:add(tensor.name, tensor.dtype, tensor.shape)
      if not added then
        fatal("BAD_METADATA", string.format("chunk %s, %s: %s", tostring(k), tensor.name, reason))
      end
      for _, slice in ipairs(slices) do
        local span = slice.src + (slice.rows - 1) * slice.src_pitch + slice.width
        if span > tensor.bytes then
          fatal("BAD_METADATA", string.format("%s holds %d bytes; its TP slice for rank %d needs %d", tensor.name,
            tensor.bytes, self.rank, span))
        end
        local resident = self.resident_index[slice.resident]
        local target, target_offset = self.memory:place(slice, resident)
        if slice.group then
          quantized[#quantized + 1] = { group = slice.group, target = target, target_offset = target_offset,
            source = tensor.buffer, source_offset = tensor.offset + slice.src, rows = slice.rows,
            columns = slice.width / 2, target_pitch = slice.dst_pitch, source_pitch = slice.src_pitch }
        else
          copies[#copies + 1] = { target = target, target_offset = target_offset,
            source_offset = tensor.offset + slice.src, rows = slice.rows, width = slice.width,
            target_pitch = slice.dst_pitch, source_pitch = slice.src_pitch, source = tensor.buffer }
        end
        -- The slice's expected synthetic values (a check on the device): the
        -- canonical tensor is a contiguous view of its trainer tensor
        -- `source` from byte `source_offset`, in bfloat16.
        if not slice.group and type(tensor.source) == "string" and type(tensor.source_offset) == "number" then
          checks[#checks + 1] = { region = 1, name = tensor.source, offset = slice.dst, rows = slice.rows,
            elements = slice.width / 2, pitch = slice.dst_pitch, first = (tensor.source_offset + slice.src) / 2,
            element_pitch = slice.src_pitch / 2 }
        end
        util.append_unseen(residents, seen, resident)
      end
    end
  end)
  -- (A tensor that names its `buffer` is read from that imported memory: the
  -- direct path, where the memories are the trainer's storage.)
  local direct = tensors[1] ~= nil and tensors[1].buffer ~= nil
  local transform = self:transform_of(k, quantized, residents, seen)
  local chunk = { copies = copies, checks = checks, segment = segment, tensors = #tensors, residents = residents,
    direct = direct, transform = transform }
  self.load_plans:put(k, chunk)
  return chunk
end

--- The transform of chunk `k` (nil when it quantizes nothing) from its
--- quantized slices (`quantized`, each naming its loader plan group):
--- `{groups = {{target, scale_offset}}, ops = {{group, target, target_offset,
--- source, source_offset, rows, columns, target_pitch, source_pitch}}}`, the
--- groups numbered from 1 in the order the slices name them, their scales
--- placed by the memory; the scale residents join `residents` (`seen`: those
--- already there). A chunk must carry every slice of each group it touches,
--- since one scale covers them (the plan's chunks keep them together,
--- wsync.plan.build): fails PLAN_INVALID naming the parameter otherwise.
---@param k integer
---@param quantized table[]
---@param residents integer[]
---@param seen table<integer, boolean>
function Loader:transform_of(k, quantized, residents, seen)
  if #quantized == 0 then
    return nil
  end
  local groups, index_of, counts = {}, {}, {}
  for _, op in ipairs(quantized) do
    local g = op.group
    if not index_of[g] then
      local group = self.plan.groups[g]
      local resident = self.resident_index[group.scale]
      local target, scale_offset = self.memory:place({ resident = group.scale, dst = group.scale_dst }, resident)
      groups[#groups + 1] = { target = target, scale_offset = scale_offset, plan_group = g }
      index_of[g], counts[g] = #groups, 0
      if not seen[resident] then
        seen[resident] = true
        residents[#residents + 1] = resident
      end
    end
    counts[g] = counts[g] + 1
    op.group = index_of[g]
  end
  for _, group in ipairs(groups) do
    local planned = self.plan.groups[group.plan_group]
    if counts[group.plan_group] ~= planned.slices then
      fatal("PLAN_INVALID", string.format("TP worker %d, chunk %s: it carries %d of the %d slices under the FP8 "
        .. "scale of %s (%s); one scale covers them all, so one chunk must carry them all (chunks planned under "
        .. "quantization fp8 do)", self.rank, tostring(k), counts[group.plan_group], planned.slices, planned.name,
        table.concat(planned.tensors, ", ")))
    end
  end
  return { groups = groups, ops = quantized }
end

-- The update in progress; without one, fails NOT_UPDATING with `refusal`.
function Loader:_update(refusal)
  if not self.update then
    fatal("NOT_UPDATING", refusal)
  end
  return self.update
end

--- load_chunk{chunk, buffer, tensors, gate?}: copies this rank's TP slice of
--- every canonical tensor of the chunk from the packed buffer into the
--- resident memory, in one transport call. `tensors` comes with a chunk's
--- first load after init_weights; the chunk's plan is made from it then and
--- kept by chunk number, and later loads omit it.
function Loader:load_chunk(payload)
  local update = self:_update("load_chunk outside start_update/finish_update")
  local buffer = self:buffer(payload.buffer, "load_chunk")
  local k = payload.chunk
  local chunk = self.load_plans:get(k)
  if payload.tensors then
    chunk = self:_plan_chunk(k, payload.tensors)
  elseif not chunk then
    fatal("BAD_METADATA", string.format("chunk %s comes without tensor metadata, and none came before", tostring(k)))
  end
  if chunk.direct then
    buffer = self.imported -- every memory of the trainer's storage
  end
  local resident = self.memory:resident()
  if not chunk.plan or (self.transport.BINDS_MEMORY and (chunk.resident ~= resident or chunk.buffer ~= buffer)) then
    -- (A plan that holds addresses is made again for memory that moved.)
    self.transport.close_plan(chunk.plan)
    local plan, message = self.transport.plan_load(resident, buffer, chunk.copies, chunk.transform)
    if not plan then
      fatal("LOAD_FAILED", string.format("TP worker %d, chunk %s: cannot plan the load: %s", self.rank, tostring(k),
        tostring(message)))
    end
    chunk.plan, chunk.resident, chunk.buffer = plan, resident, buffer
  end
  -- (payload.gate {seq, last}: chunks ordered on the device; the load is
  -- queued behind the rank's fill, and waited for with the last chunk.)
  local gate = nil
  if payload.gate ~= nil then
    if not self.gate then
      fatal("NO_GATE", string.format("TP worker %d: load_chunk ordered on the device, and init_weights mapped no gate",
        self.rank))
    end
    gate = { memory = self.gate, seq = payload.gate.seq, last = payload.gate.last == true }
  end
  local bytes, seconds = self.transport.load(resident, buffer, chunk.plan,
    string.format("TP worker %d, chunk %s", self.rank, tostring(k)), gate)
  if not bytes then
    fatal("LOAD_FAILED", seconds)
  end
  self.gate_pending = gate ~= nil and not gate.last or nil
  update.loaded[#update.loaded + 1] = k
  -- Resident tensors filled in this update: each counted once (a chunk
  -- lists each of its residents once; another chunk may fill one again).
  local filled, epoch, touched = self.filled, update.epoch, update.touched
  for _, index in ipairs(chunk.residents) do
    if filled[index] ~= epoch then
      filled[index] = epoch
      touched = touched + 1
    end
  end
  update.touched = touched
  update.tensors = update.tensors + chunk.tensors
  update.bytes = update.bytes + bytes
  return { rank = self.rank, tensors = chunk.tensors, bytes = bytes, copy_seconds = seconds }
end

--- finish_update{publication_id, model_version}: ends the update and returns
--- this rank's receipt, made from the header it got at start_update (the
--- request must name the same publication).
function Loader:finish_update(payload)
  local update = self:_update("finish_update without start_update")
  local header = update.header or {}
  if payload.publication_id ~= header.publication_id or payload.model_version ~= header.model_version then
    fatal("WRONG_PUBLICATION", string.format("finish_update for publication %s version %s; this worker is updating "
      .. "publication %s version %s", tostring(payload.publication_id), tostring(payload.model_version),
      tostring(header.publication_id), tostring(header.model_version)))
  end
  self.update = nil
  if self.gate_pending then
    -- (Loads ordered on the device whose last was not asked for: a
    -- publication cut short. Its receipt waits for what was queued.)
    self.gate_pending = nil
    local ok, reason = self.transport.settle(self.context.device)
    if not ok then
      fatal("LOAD_FAILED", string.format("TP worker %d: the loads queued on the device failed: %s", self.rank,
        tostring(reason)))
    end
  end
  local manifest, message = self.load_plans:manifest(update.loaded)
  if not manifest then
    fatal("MANIFEST", string.format("TP worker %d: %s", self.rank, tostring(message)))
  end
  return {
    publication_id = header.publication_id,
    model_version = header.model_version,
    tp_rank = self.rank,
    tp_world = self.world,
    uuid = self.device.uuid,
    manifest = manifest.digest,
    tensors = update.tensors,
    bytes = update.bytes,
    resident_tensors = update.touched,
  }
end

-- The residents as one memory for `action` ("check"), or a refusal: the
-- memory's own reason when it is never read back, else unless planned and
-- present (awake).
function Loader:_flat_residents(action)
  local flat, never = self.memory:flat()
  if never then
    refuse(never)
  end
  if not self.plan or not flat then
    refuse(string.format("no resident weights to %s (not initialized, or asleep)", action))
  end
  return flat
end

--- resident_check{step}: checks every resident slice that a chunk filled
--- against wsync's synthetic values of trainer step `step`, on the device
--- where the transport can (the synthetic trainer's values; for checks of
--- models too large to read back). Returns {rank, checked, mismatches, op?,
--- element?}.
function Loader:resident_check(payload)
  local flat = self:_flat_residents("check")
  if not transport_module.can(self.transport, "device_check") then
    refuse(string.format("the %s transport checks resident weights on the host (resident_checksums)",
      self.transport.NAME))
  end
  local ops, checked = {}, 0
  for k = 1, self.load_plans:count() do
    local chunk = self.load_plans:get(k)
    for _, op in ipairs(chunk and chunk.checks or {}) do
      ops[#ops + 1] = op
      checked = checked + op.rows * op.elements
    end
  end
  local result, message = self.transport.check_synthetic(flat, ops, payload.step)
  if not result then
    fatal("CHECK_FAILED", string.format("TP worker %d: %s", self.rank, tostring(message)))
  end
  return { rank = self.rank, checked = checked, ops = #ops, mismatches = result.mismatches, op = result.op,
    element = result.element }
end

--- weights_digest{}: a digest of the resident weights as they are now, for
--- the toy decoder of wsync.runtime.decoder: SHA-256 over the SHA-256 of
--- the first 256 bytes of every resident tensor (of the first 4 KiB of the
--- weights before a loader plan exists), cheap on any model size.
function Loader:weights_digest()
  local flat = self.memory:flat()
  if not flat then
    refuse("no resident weights to digest (asleep, or the engine's)")
  end
  local parts = {}
  local spans = {}
  if self.plan then
    for index, tensor in ipairs(self.plan.tensors) do
      spans[index] = { tensor.offset, math.min(256, tensor.bytes) }
    end
  else
    spans[1] = { 0, math.min(4096, flat:size()) }
  end
  for index, span in ipairs(spans) do
    local sum, message = self.transport.checksum(flat, span[1], span[2])
    if not sum then
      fatal("CHECKSUM_FAILED", string.format("TP worker %d: weights digest: %s", self.rank, tostring(message)))
    end
    parts[index] = sum
  end
  return { rank = self.rank, digest = require("wsync.native.digest").sha256_hex(table.concat(parts)) }
end

--- resident_checksums{}: SHA-256 of every resident tensor, by name.
function Loader:resident_checksums()
  local flat = self:_flat_residents("checksum")
  local sums = {}
  for _, tensor in ipairs(self.plan.tensors) do
    local sum, message = self.transport.checksum(flat, tensor.offset, tensor.bytes)
    if not sum then
      fatal("CHECKSUM_FAILED", string.format("TP worker %d, %s: %s", self.rank, tensor.name, tostring(message)))
    end
    sums[tensor.name] = sum
  end
  return { rank = self.rank, tensors = sums }
end

--- resident_values{}: the values sum of every resident tensor (the check of
--- a publication against the trainer's own values, wsync.plan.values), by
--- name, over the bytes the loader plan fills.
function Loader:resident_values()
  if not self.plan or not self.memory:resident() then
    refuse("no resident weights to sum (not initialized, or asleep)")
  end
  local weights, message = self.memory:host_copy(self.plan)
  if not weights then
    fatal("VALUES_FAILED", string.format("TP worker %d: %s", self.rank, tostring(message)))
  end
  local ok, sums = pcall(require("wsync.plan.values").resident, self.plan, weights)
  self.memory:close_host_copy(weights)
  if not ok then
    fatal("VALUES_FAILED", string.format("TP worker %d: %s", self.rank, tostring(sums)))
  end
  return { rank = self.rank, tensors = sums }
end

--- Unmaps every buffer the loader holds, drops its plans and any update, and
--- has the memory release its residents.
function Loader:release_all()
  self:_close_gate()
  self.transport.close_imported(self.imported)
  self.imported = {}
  self.load_plans:clear()
  self.update = nil
  self.memory:release()
end

return M
