--- A TP worker of the reference runtime (`wsync runtime-worker`), one process
--- per TP rank as in vLLM's executor. It owns the rank's resident weights and
--- KV arena and answers the main process over its control channel.
---
--- Memory: the resident weights and the KV arena are the backend's device
--- memory, from the transport (wsync.transport: private anonymous memory on
--- the host backend); sleep level 1 moves the weights into a host copy and
--- frees the device copy; level 2 discards them; wake(weights) restores or
--- re-allocates (zeroed). The weights start as deterministic dummy bytes, like
--- vLLM's dummy load format, until a publication writes real ones.
---
--- Weight transfer: the packed buffers are imported once per init_weights;
--- each chunk's loads and its part of the manifest are planned at its first
--- load (when its tensor metadata comes) and kept, so a publication runs one
--- transport call and one digest update per chunk.
local uv = require("luv")
local errors = require("wsync.errors")
local manifest_module = require("wsync.native.manifest")
local plan_module = require("wsync.plan")
local process = require("wsync._process")
local server_module = require("wsync.control.server")
local shm = require("wsync.native.shm")
local transport_module = require("wsync.transport")
local util = require("wsync.util")
local device = require("wsync.native.device")

local M = {}

local function refuse(message)
  errors.raise("STATE_REFUSED", message)
end

local function fatal(code, message)
  errors.raise(code, message, { fatal = true })
end

-- Host memory (the level-1 copy of the weights).
local function allocate_host(bytes, what)
  local buffer, message = shm.anonymous(math.max(bytes, 1))
  if not buffer then
    fatal("OUT_OF_MEMORY", string.format("cannot allocate %d bytes of %s: %s", bytes, what, message))
  end
  return buffer
end

-- Copies the device weights `memory` into host memory `host`, or back with
-- `back`, or a fatal error naming `what` (whatever failed: the worker's
-- memory state is no longer known).
local function copy_host(transport, memory, host, back, what)
  local called, ok, message = pcall(transport.copy_host, memory, host, back)
  if not called or not ok then
    fatal("COPY_FAILED", string.format("%s: %s", what, tostring(called and message or ok)))
  end
end

-- The dummy pattern of a rank, 64 KiB (a device fills with its first byte).
local function dummy_pattern(rank)
  local block = {}
  for i = 0, 255 do
    block[#block + 1] = string.char((i * 7 + rank * 31 + 1) % 256)
  end
  return table.concat(block):rep(256)
end

---@class wsync.ReferenceWorker
local Worker = {}
Worker.__index = Worker
M.Worker = Worker -- its methods, for tests

-- Device memory from the transport, its pages backed at once: a
-- publication's loads then take no page fault per page.
function Worker:_allocate(bytes, what)
  local memory, message = self.transport.allocate(bytes, what, self.context)
  if not memory then
    fatal("OUT_OF_MEMORY", string.format("TP worker %d: %s", self.rank, message))
  end
  return memory
end

function Worker:state()
  return { weights = self.weights_state, kv_cache = self.kv and "reserved" or "free" }
end

function Worker:memory()
  if self.external then
    return { device_bytes = 0, host_bytes = 0 } -- (the engine's parameters: the engine's to say)
  end
  return {
    device_bytes = (self.weights and self.weights:size() or 0) + (self.kv and self.kv:size() or 0),
    host_bytes = self.host_copy and self.host_copy:size() or 0,
  }
end

function Worker:info()
  return {
    rank = self.rank,
    world = self.world,
    pid = uv.os_getpid(),
    device = self.device,
    state = self:state(),
    memory = self:memory(),
  }
end

local function release(buffer)
  if buffer then
    buffer:close()
  end
  return nil
end

function Worker:sleep(payload)
  if self.update then
    refuse("cannot sleep during a weight update")
  end
  local level = payload.level
  if level ~= 1 and level ~= 2 then
    errors.raise("INVALID_ARGUMENT", "sleep level must be 1 or 2, got " .. tostring(level))
  end
  self.kv = release(self.kv)
  if self.weights_state == "awake" then
    if level == 1 then
      self.host_copy = allocate_host(self.weights:size(), "host memory for the level-1 weight copy")
      copy_host(self.transport, self.weights, self.host_copy, false, "the level-1 copy of the weights")
      self.weights_state = "offloaded"
    else
      self.weights_state = "discarded"
    end
    self.weights = release(self.weights)
  elseif self.weights_state == "offloaded" and level == 2 then
    self.host_copy = release(self.host_copy)
    self.weights_state = "discarded"
  end
  return self:info()
end

local WAKE_TAGS = { weights = 1, kv_cache = 2 }

function Worker:wake(payload)
  local tags = payload.tags
  if type(tags) ~= "table" or #tags == 0 then
    errors.raise("INVALID_ARGUMENT", "wake needs a non-empty list of tags (weights, kv_cache)")
  end
  local wanted = {}
  for _, tag in ipairs(tags) do
    if not WAKE_TAGS[tag] then
      errors.raise("INVALID_ARGUMENT", string.format("unknown wake tag '%s' (weights, kv_cache)", tostring(tag)))
    end
    wanted[tag] = true
  end
  if wanted.weights and self.weights_state ~= "awake" then
    local weights = self:_allocate(self.weights_bytes, "resident weights")
    if self.weights_state == "offloaded" then
      copy_host(self.transport, weights, self.host_copy, true, "the weights back from their level-1 copy")
      self.host_copy = release(self.host_copy)
    end
    self.weights = weights
    self.weights_state = "awake"
  end
  if wanted.kv_cache and not self.kv then
    if self.weights_state ~= "awake" then
      refuse(string.format("cannot wake kv_cache while the weights are %s: wake weights first",
        self.weights_state))
    end
    self.kv = self:_allocate(self.kv_bytes, "the KV cache arena")
  end
  return self:info()
end

function Worker:checksum()
  return {
    rank = self.rank,
    weights = self.weights and self.transport.checksum(self.weights, 0, self.weights:size()) or nil,
    kv_cache = self.kv and self.transport.checksum(self.kv, 0, self.kv:size()) or nil,
  }
end

-- Weight transfer --------------------------------------------------------------

-- Drops the chunks' load plans (a new init_weights).
function Worker:_forget_chunks()
  for _, chunk in pairs(self.chunks or {}) do
    chunk.segment:close()
    self.transport.close_plan(chunk.plan)
  end
  self.chunks, self.segments = {}, {}
  self.digests = self.digests or manifest_module.digest_cache()
  self.digests:clear()
end

--- init_weights{family, config, tp, transport, buffers}: once per runtime
--- (and again only with a new session's buffers). Computes this rank's
--- loader plan, sizes the resident storage to it (zeroed while awake), and
--- imports the rank's packed buffers once; the mappings are kept and reused.
function Worker:init_weights(payload)
  local family = plan_module.family(payload.family)
  local config = family.config(payload.config)
  if payload.tp ~= self.world then
    fatal("TOPOLOGY", string.format("init_weights for TP %d sent to a worker of TP %d", payload.tp, self.world))
  end
  if payload.transport ~= self.transport.NAME then
    fatal("TRANSPORT", string.format("init_weights for transport %s; TP worker %d moves weights over %s",
      tostring(payload.transport), self.rank, self.transport.NAME))
  end
  local plan = family.loader_plan(config, self.world, self.rank)
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
  self:_forget_chunks()
  -- Resident tensors by index, for the receipts' count of those filled.
  self.resident_index = {}
  for index, tensor in ipairs(plan.tensors) do
    self.resident_index[tensor.name] = index
  end
  self.weights_bytes = plan.bytes
  if self.external then
    self:bind_residents(payload.residents)
  elseif self.weights_state == "awake" then
    self.weights = release(self.weights)
    self.weights = self:_allocate(plan.bytes, "resident weights")
  else
    self.host_copy = release(self.host_copy)
    self.weights_state = "discarded"
  end
  return { resident_tensors = #plan.tensors, resident_bytes = plan.bytes, buffers = #payload.buffers,
    ordered = self.gate ~= nil }
end

-- Unmaps the rank's gate, after waiting for the loads queued behind it.
function Worker:_close_gate()
  if self.gate then
    if self.gate_pending then
      self.transport.settle(self.context.device)
      self.gate_pending = nil
    end
    self.gate:close()
    self.gate = nil
  end
end

--- start_update{header}: enters update mode; no generation until finish.
function Worker:start_update(payload)
  if not self.plan then
    fatal("NOT_INITIALIZED", "start_update before init_weights")
  end
  if self.external then
    -- (The engine sleeps and wakes its own parameters; where they lie now,
    -- or word that they lie where they were bound last.)
    if payload.residents_unchanged == true then
      if not self.weights then
        fatal("DIRECT_UNSUPPORTED", "start_update says the engine's parameters are where they were bound, and "
          .. "none are bound")
      end
    else
      self:bind_residents(payload.residents)
    end
  elseif self.weights_state ~= "awake" then
    refuse(string.format("cannot update weights that are %s: wake weights first", self.weights_state))
  end
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
-- of the manifest, and the resident tensors it fills.
function Worker:_plan_chunk(k, tensors)
  local copies_by_name = self.plan.copies
  local copies, residents, checks = {}, {}, {}
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
        local target, target_offset = nil, slice.dst
        if self.external then
          -- (Each resident tensor is its own memory: the engine's parameter.)
          target = self.resident_index[slice.resident]
          target_offset = slice.dst - self.plan.by_name[slice.resident].offset
        end
        copies[#copies + 1] = { target = target, target_offset = target_offset,
          source_offset = tensor.offset + slice.src, rows = slice.rows, width = slice.width,
          target_pitch = slice.dst_pitch, source_pitch = slice.src_pitch, source = tensor.buffer }
        -- The slice's expected synthetic values (a check on the device): the
        -- canonical tensor is a contiguous view of its trainer tensor
        -- `source` from byte `source_offset`, in bfloat16.
        if type(tensor.source) == "string" and type(tensor.source_offset) == "number" then
          checks[#checks + 1] = { region = 1, name = tensor.source, offset = slice.dst, rows = slice.rows,
            elements = slice.width / 2, pitch = slice.dst_pitch, first = (tensor.source_offset + slice.src) / 2,
            element_pitch = slice.src_pitch / 2 }
        end
        residents[#residents + 1] = self.resident_index[slice.resident]
      end
    end
  end)
  -- (A tensor that names its `buffer` is read from that imported memory: the
  -- direct path, where the memories are the trainer's storage.)
  local direct = tensors[1] ~= nil and tensors[1].buffer ~= nil
  local chunk = { copies = copies, checks = checks, segment = segment, tensors = #tensors, residents = residents,
    direct = direct }
  if self.chunks[k] then
    self.chunks[k].segment:close()
    self.transport.close_plan(self.chunks[k].plan)
  end
  self.chunks[k], self.segments[k] = chunk, segment
  self.digests:clear()
  return chunk
end

-- The update in progress; without one, fails NOT_UPDATING with `refusal`.
function Worker:_update(refusal)
  if not self.update then
    fatal("NOT_UPDATING", refusal)
  end
  return self.update
end

--- load_chunk{chunk, buffer, tensors}: copies this rank's TP slice of every
--- canonical tensor of the chunk from the packed buffer into resident storage,
--- in one transport call. `tensors` comes with a chunk's first load after
--- init_weights; the chunk's plan is made from it then and kept by chunk
--- number, and later loads omit it.
function Worker:load_chunk(payload)
  local update = self:_update("load_chunk outside start_update/finish_update")
  local buffer = self.imported[payload.buffer]
  if not buffer then
    fatal("NO_BUFFER", string.format("load_chunk names buffer %s; %d are mapped", tostring(payload.buffer),
      #self.imported))
  end
  local k = payload.chunk
  local chunk = self.chunks[k]
  if payload.tensors then
    chunk = self:_plan_chunk(k, payload.tensors)
  elseif not chunk then
    fatal("BAD_METADATA", string.format("chunk %s comes without tensor metadata, and none came before", tostring(k)))
  end
  if chunk.direct then
    buffer = self.imported -- every memory of the trainer's storage
  end
  if not chunk.plan or (self.transport.BINDS_MEMORY and (chunk.resident ~= self.weights or chunk.buffer ~= buffer)) then
    -- (A plan that holds addresses is made again for reallocated weights.)
    self.transport.close_plan(chunk.plan)
    local plan, message = self.transport.plan_load(self.weights, buffer, chunk.copies)
    if not plan then
      fatal("LOAD_FAILED", string.format("TP worker %d, chunk %s: cannot plan the load: %s", self.rank, tostring(k),
        tostring(message)))
    end
    chunk.plan, chunk.resident, chunk.buffer = plan, self.weights, buffer
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
  local bytes, seconds = self.transport.load(self.weights, buffer, chunk.plan,
    string.format("TP worker %d, chunk %s", self.rank, tostring(k)), gate)
  if not bytes then
    fatal("LOAD_FAILED", seconds)
  end
  self.gate_pending = gate ~= nil and not gate.last or nil
  update.loaded[#update.loaded + 1] = k
  -- Resident tensors filled in this update: each counted once.
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
--- this worker's receipt, made from the header this worker got at
--- start_update (the request must name the same publication).
function Worker:finish_update(payload)
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
  local manifest, message = self.digests:of(update.loaded, self.segments)
  if not manifest then
    fatal("MANIFEST", string.format("TP worker %d: %s", self.rank, tostring(message)))
  end
  local digest = manifest.digest
  return {
    publication_id = header.publication_id,
    model_version = header.model_version,
    tp_rank = self.rank,
    tp_world = self.world,
    uuid = self.device.uuid,
    manifest = digest,
    tensors = update.tensors,
    bytes = update.bytes,
    resident_tensors = update.touched,
  }
end

-- Refuses to `action` ("check") the resident weights unless this worker holds
-- them itself: planned, awake, not the engine's parameters.
function Worker:_own_residents(action)
  if self.external then
    refuse("the resident tensors are the engine's parameters: this worker does not read them back")
  end
  if not self.plan or not self.weights then
    refuse(string.format("no resident weights to %s (not initialized, or asleep)", action))
  end
end

--- resident_check{step}: checks every resident slice that a chunk filled
--- against wsync's synthetic values of trainer step `step`, on the device
--- where the transport can (the synthetic trainer's values; for checks of
--- models too large to read back). Returns {rank, checked, mismatches, op?,
--- element?}.
function Worker:resident_check(payload)
  self:_own_residents("check")
  if not transport_module.can(self.transport, "device_check") then
    refuse(string.format("the %s transport checks resident weights on the host (resident_checksums)",
      self.transport.NAME))
  end
  local ops, checked = {}, 0
  for k = 1, #self.chunks do
    for _, op in ipairs(self.chunks[k] and self.chunks[k].checks or {}) do
      ops[#ops + 1] = op
      checked = checked + op.rows * op.elements
    end
  end
  local result, message = self.transport.check_synthetic(self.weights, ops, payload.step)
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
function Worker:weights_digest()
  if self.external or not self.weights then
    refuse("no resident weights to digest (asleep, or the engine's)")
  end
  local parts = {}
  local spans = {}
  if self.plan then
    for index, tensor in ipairs(self.plan.tensors) do
      spans[index] = { tensor.offset, math.min(256, tensor.bytes) }
    end
  else
    spans[1] = { 0, math.min(4096, self.weights:size()) }
  end
  for index, span in ipairs(spans) do
    local sum, message = self.transport.checksum(self.weights, span[1], span[2])
    if not sum then
      fatal("CHECKSUM_FAILED", string.format("TP worker %d: weights digest: %s", self.rank, tostring(message)))
    end
    parts[index] = sum
  end
  return { rank = self.rank, digest = require("wsync.native.digest").sha256_hex(table.concat(parts)) }
end

--- resident_checksums{}: SHA-256 of every resident tensor, by name.
function Worker:resident_checksums()
  self:_own_residents("checksum")
  local sums = {}
  for _, tensor in ipairs(self.plan.tensors) do
    local sum, message = self.transport.checksum(self.weights, tensor.offset, tensor.bytes)
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
function Worker:resident_values()
  if not self.plan or not self.weights then
    refuse("no resident weights to sum (not initialized, or asleep)")
  end
  local weights, message
  if self.external then
    weights, message = self:_gather_residents()
  else
    weights, message = self.transport.host_copy(self.weights)
  end
  if not weights then
    fatal("VALUES_FAILED", string.format("TP worker %d: %s", self.rank, tostring(message)))
  end
  local ok, sums = pcall(require("wsync.plan.values").resident, self.plan, weights)
  if self.external then
    weights:close()
  end
  if not ok then
    fatal("VALUES_FAILED", string.format("TP worker %d: %s", self.rank, tostring(sums)))
  end
  return { rank = self.rank, tensors = sums }
end

-- The engine's parameters in host memory, laid out as the loader plan lays
-- out one worker's resident storage (the values check reads that layout).
-- Returns the host buffer (the caller closes it), or nil and why.
function Worker:_gather_residents()
  local copy = require("wsync.native.copy")
  local flat = allocate_host(self.plan.bytes, "host memory for the values check")
  for index, tensor in ipairs(self.plan.tensors) do
    local host, message = self.transport.host_copy(self.weights[index], self.context.device)
    local moved = nil
    if host then
      local batch = copy.batch(1)
      batch:add(tensor.offset, 0, 1, tensor.bytes)
      moved, message = copy.run(flat, host, batch, tensor.name)
    end
    if not moved then
      flat:close()
      return nil, string.format("%s: %s", tensor.name, tostring(message))
    end
  end
  return flat
end

-- Unmaps and frees every buffer this worker holds.
function Worker:release_all()
  self:_close_gate()
  self.transport.close_imported(self.imported)
  self.imported = {}
  self:_forget_chunks()
  self.update = nil
  if self.external then
    self.weights = nil -- (the engine's parameters)
  else
    self.weights = release(self.weights)
  end
  self.host_copy = release(self.host_copy)
  self.kv = release(self.kv)
end

function Worker:close()
  self:release_all()
  self.server:close()
end

-- A worker over another engine's parameters ---------------------------------

--- Binds the resident tensors of the loader plan to the engine's parameters
--- (`residents`: name -> {pointer, size, dtype, shape}, the pointer a
--- number): every tensor the plan fills must be there with its dtype, shape
--- and size, and the engine may have no parameter the plan does not fill (it
--- would keep stale weights). A chunk's load plan is made again only when a
--- parameter moved.
---@param residents table<string, {pointer: number, size: integer, dtype: string, shape: integer[]}>
function Worker:bind_residents(residents)
  if type(residents) ~= "table" then
    fatal("DIRECT_UNSUPPORTED", "no resident parameters were given to the loader")
  end
  local regions, moved = {}, self.weights == nil
  for index, tensor in ipairs(self.plan.tensors) do
    local parameter = residents[tensor.name]
    if type(parameter) ~= "table" then
      fatal("DIRECT_UNSUPPORTED", string.format("TP worker %d: the engine has no parameter %s, which the loader "
        .. "plan fills", self.rank, tensor.name))
    end
    local same_shape = type(parameter.shape) == "table" and #parameter.shape == #tensor.shape
    for dim = 1, same_shape and #tensor.shape or 0 do
      same_shape = same_shape and parameter.shape[dim] == tensor.shape[dim]
    end
    if parameter.dtype ~= tensor.dtype or not same_shape or parameter.size ~= tensor.bytes then
      fatal("DIRECT_UNSUPPORTED", string.format("TP worker %d: the engine's %s is %s %s (%s bytes); the loader "
        .. "plan fills %s %s (%d bytes)", self.rank, tensor.name, tostring(parameter.dtype),
        require("cjson").encode(parameter.shape or {}), tostring(parameter.size), tensor.dtype,
        require("cjson").encode(tensor.shape), tensor.bytes))
    end
    regions[index] = { pointer = parameter.pointer, size = parameter.size, device = self.context.device }
    local before = self.weights and self.weights[index]
    moved = moved or before == nil or before.pointer ~= parameter.pointer
  end
  for name in pairs(residents) do
    if not self.plan.by_name[name] then
      fatal("DIRECT_UNSUPPORTED", string.format("TP worker %d: the engine's parameter %s is not in the loader plan "
        .. "(it would keep stale weights)", self.rank, name))
    end
  end
  if moved then
    self.weights = regions
  end
end

--- A worker that loads into another engine's parameters (the vllm runtime's
--- worker extension, through libwsync inside that engine's process): no
--- resident memory of its own, no sleep or wake (the engine's), the same
--- weight commands. `options`: {rank, world, backend, device}.
---@param options {rank: integer, world: integer, backend: string, device: integer}
---@return wsync.ReferenceWorker
function M.external(options)
  local info, message = device.query(options.backend, options.device)
  if not info then
    errors.raise("RUNTIME_START", string.format("TP worker %d: device %s:%s: %s", options.rank, options.backend,
      tostring(options.device), message))
  end
  local self = setmetatable({
    rank = options.rank,
    world = options.world,
    device = { backend = options.backend, index = info.index, uuid = info.uuid, name = info.name },
    weights_state = "awake",
    external = true,
  }, Worker)
  self.transport = transport_module.for_backend(options.backend)
  self.context = { device = info.index }
  return self
end

--- mapped{buffer}: where this worker's mapping of its rank's packed buffer
--- `buffer` (a slot, 1-based) lies: {pointer, size, device} (the check of the
--- direct loader against the engine's own loader reads the chunk there). The
--- pointer is a decimal string: lua-cjson 2.1 writes numbers with at most 14
--- significant digits, and a device address has 15.
function Worker:mapped(payload)
  local memory = self.imported and self.imported[payload.buffer]
  if not memory then
    fatal("NO_BUFFER", string.format("mapped names buffer %s; %d are mapped", tostring(payload.buffer),
      #(self.imported or {})))
  end
  if type(memory.region) ~= "function" then
    refuse(string.format("the %s transport's buffers are not device regions", self.transport.NAME))
  end
  local region = memory:region()
  region.pointer = string.format("%.0f", region.pointer)
  return region
end

local embedded = nil
local EMBEDDED_COMMANDS = { init_weights = true, start_update = true, load_chunk = true, finish_update = true,
  info = true, resident_values = true, mapped = true }

--- Runs one command on this process's external worker and returns its result,
--- or raises its failure (a wsync error; a bug's as WORKER_FAILED, fatal): the
--- entry of an engine's worker extension (bindings/python/wsync/vllm, through
--- ws_host_call's `worker_command`). "open" makes the worker ({rank, world,
--- backend, device}), "close" drops it.
---@param cmd string
---@param payload table
---@return table
function M.embedded_call(cmd, payload)
  local ok, result = pcall(function()
    if cmd == "open" then
      if embedded then
        embedded:release_all()
      end
      embedded = M.external(payload)
      return embedded:info()
    elseif cmd == "close" then
      if embedded then
        embedded:release_all()
        embedded = nil
      end
      return {}
    end
    if not embedded then
      fatal("NOT_INITIALIZED", cmd .. " before the worker was opened")
    end
    if not EMBEDDED_COMMANDS[cmd] then
      errors.raise("UNKNOWN_COMMAND", "the embedded worker has no command '" .. tostring(cmd) .. "'")
    end
    return embedded[cmd](embedded, payload)
  end)
  if ok then
    return result
  end
  if errors.is(result) then
    result.fatal = result.fatal ~= false
    error(result, 0)
  end
  errors.raise("WORKER_FAILED", tostring(result), { fatal = true })
end

---@class wsync.ReferenceWorkerOptions
---@field rank integer
---@field world integer
---@field backend string
---@field device_index integer
---@field weights_bytes integer
---@field kv_bytes integer
---@field fault string?

--- Runs a worker until its main process shuts it down or goes away.
---@param options wsync.ReferenceWorkerOptions
function M.main(options)
  -- Die with the process that started this one; refuse to run on when it
  -- is already gone (nobody would ever stop this process).
  local parent_ok, parent_gone = process.die_with_parent("SIGKILL", tonumber(os.getenv("WSYNC_PARENT_PID")))
  if not parent_ok then
    errors.raise("RUNTIME_START", "the process that started this one is gone: " .. tostring(parent_gone))
  end
  local info, message = device.query(options.backend, options.device_index)
  if not info then
    errors.raise("RUNTIME_START", string.format("TP worker %d: device %s:%d: %s", options.rank, options.backend,
      options.device_index, message))
  end
  local self = setmetatable({
    rank = options.rank,
    world = options.world,
    weights_bytes = options.weights_bytes,
    kv_bytes = options.kv_bytes,
    device = { backend = options.backend, index = info.index, uuid = info.uuid, name = info.name },
    weights_state = "awake",
  }, Worker)
  self.transport = transport_module.for_backend(options.backend)
  self.context = { device = info.index }
  self.weights = self:_allocate(self.weights_bytes, "resident weights")
  local filled, reason = self.transport.fill_pattern(self.weights, dummy_pattern(self.rank))
  if not filled then
    errors.raise("RUNTIME_START", string.format("TP worker %d: dummy weights: %s", self.rank, tostring(reason)))
  end

  local handlers = util.method_handlers(self, {
    info = Worker.info, sleep = Worker.sleep, wake = Worker.wake, checksum = Worker.checksum,
    init_weights = Worker.init_weights, start_update = Worker.start_update, load_chunk = Worker.load_chunk,
    finish_update = Worker.finish_update, resident_checksums = Worker.resident_checksums,
    resident_check = Worker.resident_check, resident_values = Worker.resident_values,
    weights_digest = Worker.weights_digest,
  })
  handlers.process_memory = function()
    return util.memory_usage()
  end
  handlers.release = function()
    -- Buffers stay mapped (policy "keep"); nothing reads them now.
    if self.update then
      refuse("release during an update")
    end
    return { rank = self.rank, mapped = #(self.imported or {}) }
  end
  handlers.shutdown = function()
    self.server.after_answer = function()
      self:release_all()
      self.server:close_after_flush()
    end
    return {}
  end
  self.server = server_module.serve({
    name = string.format("TP worker %d", self.rank),
    -- No polling after an answer: the TP workers answer one main process at
    -- once, and polling together they would take its cores ($WSYNC_WORKER_SPIN_US
    -- turns it on).
    spin_us = tonumber(os.getenv("WSYNC_WORKER_SPIN_US") or "") or 0,
    handlers = handlers,
    fault = options.fault,
    on_close = function()
      -- The main process went away: nothing here may outlive it.
      self:close()
    end,
  })
  return self
end

return M
