--- A TP worker of the reference runtime (`wsync runtime-worker`), one process
--- per TP rank as in vLLM's executor. It owns the rank's resident weights and
--- KV arena and answers the main process over its control channel.
---
--- Memory on the host backend: "device" memory is private anonymous memory of
--- the worker; sleep level 1 moves the weights into a separate host copy and
--- frees the device copy; level 2 discards them; wake(weights) restores or
--- re-allocates (zeroed). The weights start as deterministic dummy bytes, like
--- vLLM's dummy load format, until a publication writes real ones.
local ffi = require("ffi")
local uv = require("luv")
local C = require("wsync.native.ffi")
local errors = require("wsync.errors")
local manifest_module = require("wsync._manifest")
local plan_module = require("wsync.plan")
local process = require("wsync._process")
local server_module = require("wsync.control.server")
local shm = require("wsync.native.shm")
local util = require("wsync.util")
local device = require("wsync.native.device")

local M = {}

local function refuse(message)
  errors.raise("STATE_REFUSED", message)
end

local function allocate(bytes, what)
  local buffer, message = shm.anonymous(bytes)
  if not buffer then
    errors.raise("OUT_OF_MEMORY", string.format("cannot allocate %d bytes of %s: %s", bytes, what, message),
      { fatal = true })
  end
  return buffer
end

-- Resident weights are faulted in when allocated, as a device allocation is
-- backed at once: a publication's loads then take no page fault per page.
local function allocate_resident(bytes)
  local buffer = allocate(bytes, "resident weights")
  if C.ws_copy_prefault(ffi.cast("void *", buffer:pointer()), buffer:size()) ~= 0 then
    local message = ffi.string(C.ws_error_detail())
    buffer:close()
    errors.raise("OUT_OF_MEMORY", string.format("cannot back %d bytes of resident weights: %s", bytes, message),
      { fatal = true })
  end
  return buffer
end

-- Fills a buffer with the dummy pattern of a rank, 64 KiB at a time.
local function fill_dummy(buffer, rank)
  local block = {}
  for i = 0, 255 do
    block[#block + 1] = string.char((i * 7 + rank * 31 + 1) % 256)
  end
  local pattern = table.concat(block):rep(256)
  local size = buffer:size()
  for offset = 0, size - 1, #pattern do
    buffer:write(offset, pattern:sub(1, math.min(#pattern, size - offset)))
  end
end

---@class wsync.ReferenceWorker
local Worker = {}
Worker.__index = Worker
M.Worker = Worker -- its methods, for tests

function Worker:state()
  return { weights = self.weights_state, kv_cache = self.kv and "reserved" or "free" }
end

function Worker:memory()
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
      self.host_copy = allocate(self.weights:size(), "host memory for the level-1 weight copy")
      assert(self.host_copy:copy_from(self.weights, 0, 0, self.weights:size()))
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
    local weights = allocate_resident(self.weights_bytes)
    if self.weights_state == "offloaded" then
      assert(weights:copy_from(self.host_copy, 0, 0, self.weights_bytes))
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
    self.kv = allocate(self.kv_bytes, "the KV cache arena")
  end
  return self:info()
end

function Worker:checksum()
  return {
    rank = self.rank,
    weights = self.weights and self.weights:sha256() or nil,
    kv_cache = self.kv and self.kv:sha256() or nil,
  }
end

-- Weight transfer --------------------------------------------------------------

local function fatal(code, message)
  errors.raise(code, message, { fatal = true })
end

--- init_weights{family, config, tp, buffers}: once per session. Computes this
--- rank's loader plan, sizes the resident storage to it (zeroed while awake),
--- and maps the rank's packed buffers once; the mappings are kept and reused.
function Worker:init_weights(payload)
  local family = plan_module.family(payload.family)
  local config = family.config(payload.config)
  if payload.tp ~= self.world then
    fatal("TOPOLOGY", string.format("init_weights for TP %d sent to a worker of TP %d", payload.tp, self.world))
  end
  local plan = family.loader_plan(config, self.world, self.rank)
  for _, buffer in pairs(self.imported or {}) do
    buffer:close()
  end
  self.imported = {}
  for slot, name in ipairs(payload.buffers) do
    local buffer, message = shm.open(name)
    if not buffer then
      fatal("IMPORT_FAILED", string.format("TP worker %d cannot map buffer %s: %s", self.rank, name, message))
    end
    self.imported[slot] = buffer
  end
  self.plan = plan
  self.chunk_tensors = {}
  self.weights_bytes = plan.bytes
  if self.weights_state == "awake" then
    self.weights = release(self.weights)
    self.weights = allocate_resident(plan.bytes)
  else
    self.host_copy = release(self.host_copy)
    self.weights_state = "discarded"
  end
  return { resident_tensors = #plan.tensors, resident_bytes = plan.bytes, buffers = #payload.buffers }
end

--- start_update{header}: enters update mode; no generation until finish.
function Worker:start_update(payload)
  if not self.plan then
    fatal("NOT_INITIALIZED", "start_update before init_weights")
  end
  if self.weights_state ~= "awake" then
    refuse(string.format("cannot update weights that are %s: wake weights first", self.weights_state))
  end
  if self.update then
    self.update.manifest:close()
  end
  self.update = { header = payload.header, manifest = assert(manifest_module.new()), tensors = 0, bytes = 0,
    touched = {} }
  return {}
end

--- load_chunk{chunk, buffer, tensors}: copies this rank's TP slice of every
--- canonical tensor of the chunk from the packed buffer into resident storage,
--- in one batch of strided copies. `tensors` comes with a chunk's first load
--- after init_weights and is kept by chunk number; later loads of the chunk
--- omit it and are checked against the kept metadata in the same way.
function Worker:load_chunk(payload)
  local update = self.update
  if not update then
    fatal("NOT_UPDATING", "load_chunk outside start_update/finish_update")
  end
  local buffer = self.imported[payload.buffer]
  if not buffer then
    fatal("NO_BUFFER", string.format("load_chunk names buffer %s; %d are mapped", tostring(payload.buffer),
      #self.imported))
  end
  local tensors = payload.tensors
  if tensors then
    self.chunk_tensors[payload.chunk] = tensors
  else
    tensors = self.chunk_tensors[payload.chunk]
    if not tensors then
      fatal("BAD_METADATA", string.format("chunk %s comes without tensor metadata, and none came before",
        tostring(payload.chunk)))
    end
  end
  local copies_by_name = self.plan.copies
  local total = 0
  for _, tensor in ipairs(tensors) do
    local copies = copies_by_name[tensor.name]
    if not copies then
      fatal("UNKNOWN_TENSOR", string.format("TP worker %d has no loader plan for %s", self.rank, tensor.name))
    end
    total = total + #copies
  end
  local ops = ffi.new("ws_copy_op[?]", math.max(total, 1))
  local count = 0
  for _, tensor in ipairs(tensors) do
    local ok, message = update.manifest:add(tensor.name, tensor.dtype, tensor.shape)
    if not ok then
      fatal("BAD_METADATA", string.format("chunk %s, %s: %s", tostring(payload.chunk), tensor.name, message))
    end
    for _, copy in ipairs(copies_by_name[tensor.name]) do
      local span = copy.src + (copy.rows - 1) * copy.src_pitch + copy.width
      if span > tensor.bytes then
        fatal("BAD_METADATA", string.format("%s holds %d bytes; its TP slice for rank %d needs %d", tensor.name,
          tensor.bytes, self.rank, span))
      end
      local op = ops[count]
      op.target_offset, op.source_offset = copy.dst, tensor.offset + copy.src
      op.rows, op.width = copy.rows, copy.width
      op.target_pitch, op.source_pitch = copy.dst_pitch, copy.src_pitch
      count = count + 1
      update.touched[copy.resident] = true
    end
  end
  local status = C.ws_copy_run(ffi.cast("void *", self.weights:pointer()), self.weights:size(),
    ffi.cast("void *", buffer:pointer()), buffer:size(), ops, count)
  if status ~= 0 then
    fatal("LOAD_FAILED", string.format("TP worker %d, chunk %s: %s", self.rank, tostring(payload.chunk),
      ffi.string(C.ws_error_detail())))
  end
  local bytes = tonumber(C.ws_copy_bytes(ops, count))
  update.tensors = update.tensors + #tensors
  update.bytes = update.bytes + bytes
  return { rank = self.rank, tensors = #tensors, bytes = bytes }
end

--- finish_update{publication_id, model_version}: ends the update and returns
--- this worker's receipt, made from the header this worker got at
--- start_update (the request must name the same publication).
function Worker:finish_update(payload)
  local update = self.update
  if not update then
    fatal("NOT_UPDATING", "finish_update without start_update")
  end
  local header = update.header or {}
  if payload.publication_id ~= header.publication_id or payload.model_version ~= header.model_version then
    fatal("WRONG_PUBLICATION", string.format("finish_update for publication %s version %s; this worker is updating "
      .. "publication %s version %s", tostring(payload.publication_id), tostring(payload.model_version),
      tostring(header.publication_id), tostring(header.model_version)))
  end
  self.update = nil
  local digest = assert(update.manifest:finish())
  update.manifest:close()
  local touched = 0
  for _ in pairs(update.touched) do
    touched = touched + 1
  end
  return {
    publication_id = header.publication_id,
    model_version = header.model_version,
    tp_rank = self.rank,
    tp_world = self.world,
    uuid = self.device.uuid,
    manifest = digest,
    tensors = update.tensors,
    bytes = update.bytes,
    resident_tensors = touched,
  }
end

--- resident_checksums{}: SHA-256 of every resident tensor, by name.
function Worker:resident_checksums()
  if not self.plan or not self.weights then
    refuse("no resident weights to checksum (not initialized, or asleep)")
  end
  local sums = {}
  for _, tensor in ipairs(self.plan.tensors) do
    sums[tensor.name] = assert(self.weights:sha256(tensor.offset, tensor.bytes))
  end
  return { rank = self.rank, tensors = sums }
end

-- Unmaps and frees every buffer this worker holds.
function Worker:release_all()
  for _, buffer in pairs(self.imported or {}) do
    buffer:close()
  end
  self.imported = {}
  if self.update then
    self.update.manifest:close()
    self.update = nil
  end
  self.weights = release(self.weights)
  self.host_copy = release(self.host_copy)
  self.kv = release(self.kv)
end

function Worker:close()
  self:release_all()
  self.server:close()
end

--- Runs a worker until its main process shuts it down or goes away.
---@param options {rank: integer, world: integer, backend: string, device_index: integer, weights_bytes: integer, kv_bytes: integer, fault: string?}
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
  if options.backend ~= "host" then
    errors.raise("RUNTIME_START", "the reference runtime's workers hold weights on the host backend only; "
      .. "its cuda data plane arrives with the GPU publication work")
  end
  local self = setmetatable({
    rank = options.rank,
    world = options.world,
    weights_bytes = options.weights_bytes,
    kv_bytes = options.kv_bytes,
    device = { backend = options.backend, index = info.index, uuid = info.uuid, name = info.name },
    weights_state = "awake",
  }, Worker)
  self.weights = allocate(self.weights_bytes, "resident weights")
  fill_dummy(self.weights, self.rank)

  local handlers = {
    info = function()
      return self:info()
    end,
    sleep = function(payload)
      return self:sleep(payload)
    end,
    wake = function(payload)
      return self:wake(payload)
    end,
    checksum = function()
      return self:checksum()
    end,
    init_weights = function(payload)
      return self:init_weights(payload)
    end,
    start_update = function(payload)
      return self:start_update(payload)
    end,
    load_chunk = function(payload)
      return self:load_chunk(payload)
    end,
    finish_update = function(payload)
      return self:finish_update(payload)
    end,
    resident_checksums = function()
      return self:resident_checksums()
    end,
    process_memory = function()
      return util.memory_usage()
    end,
    release = function()
      -- Buffers stay mapped (policy "keep"); nothing reads them now.
      if self.update then
        refuse("release during an update")
      end
      return { rank = self.rank, mapped = #(self.imported or {}) }
    end,
    shutdown = function()
      self.server.after_answer = function()
        self:release_all()
        self.server:close_after_flush()
      end
      return {}
    end,
  }
  self.server = server_module.serve({
    name = string.format("TP worker %d", self.rank),
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
