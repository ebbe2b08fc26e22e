--- The agent: wsync's part inside one trainer rank. It registers the rank's
--- tensors (name, dtype, global shape, where its dim-0 shard lives and which
--- rows it holds) and step callbacks, then joins collective publications: on
--- the host's command it allocates and exports its packed buffers, runs
--- callbacks, and fills chunks by copying its shard rows into every rank's
--- buffer (the host backend's all-gather through shared memory).
---
--- Everything here runs in coroutines on the host loop of the trainer's own
--- wsync host (the synthetic trainer, or libwsync embedded in a trainer).
local ffi = require("ffi")
local uv = require("luv")
local C = require("wsync.native.ffi")
local errors = require("wsync.errors")
local loop = require("wsync.loop")
local manifest_module = require("wsync._manifest")
local messages = require("wsync.control.messages")
local peer_module = require("wsync.control.peer")
local plan_module = require("wsync.plan")
local shm = require("wsync.native.shm")

local M = {}

---@class wsync.Agent
---@field rank integer
---@field world integer
local Agent = {}
Agent.__index = Agent

local function check(condition, message, level)
  if not condition then
    error(message, (level or 1) + 1)
  end
end

--- Connects to the host's control endpoint. Must run in a spawned coroutine.
---@param options {endpoint: string, rank: integer, world: integer, backend: string?, device_index: integer?, timeout: number?}
---@return wsync.Agent
function M.connect(options)
  check(type(options.endpoint) == "string", "agent.connect: endpoint (socket path) required", 2)
  check(type(options.rank) == "number" and type(options.world) == "number" and options.rank >= 0
    and options.rank < options.world, "agent.connect: rank must be in [0, world)", 2)
  local self = setmetatable({
    rank = options.rank,
    world = options.world,
    backend = options.backend or "host",
    device_index = options.device_index or options.rank,
    timeout = options.timeout or 600,
    tensors = {},
    by_name = {},
    callbacks = {},
    buffers = {},
    targets = nil,
  }, Agent)
  local pipe = uv.new_pipe(false)
  local connected, message = loop.await(function(resume)
    pipe:connect(options.endpoint, function(err)
      resume(err == nil, err)
    end)
  end)
  if not connected then
    pipe:close()
    errors.raise("AGENT_CONNECT", string.format("rank %d cannot connect to %s: %s", self.rank, options.endpoint,
      tostring(message)), { rank = self.rank })
  end
  self.pipe = pipe
  self.peer = peer_module.new(pipe, {
    name = "host",
    handlers = self:_handlers(),
    schemas = { requests = messages.to_agent, results = messages.from_host },
    on_close = function(reason)
      self.lost = reason
    end,
  })
  return self
end

--- Lets the loop end (wsync.loop.run) while this agent stays connected: for
--- a trainer that runs the host loop only inside its own calls (libwsync's
--- agent API), so that the host's other work does not wait on the connection.
--- The connection is still served whenever the loop runs.
function Agent:unref()
  self.pipe:unref()
end

--- Registers one tensor. `memory` is a wsync.native.shm buffer (or `{pointer =
--- lightuserdata, size = bytes}`) holding this rank's rows [first, first +
--- count) of dim 0, row-major, from byte `offset`.
---@param tensor {name: string, dtype: string, shape: integer[], memory: any, offset: integer?, rows: integer[]}
function Agent:register_tensor(tensor)
  check(type(tensor.name) == "string" and not self.by_name[tensor.name],
    "register_tensor: a new tensor name is required", 2)
  check(type(tensor.shape) == "table" and #tensor.shape >= 1 and #tensor.shape <= 8,
    "register_tensor: shape with 1 to 8 dims", 2)
  local rows = tensor.rows or { 0, tensor.shape[1] }
  local row_elements = 1
  for i = 2, #tensor.shape do
    row_elements = row_elements * tensor.shape[i]
  end
  local element = C.ws_dtype_size(C.ws_dtype_from_name(tensor.dtype, #tensor.dtype))
  check(element > 0, "register_tensor: unknown dtype " .. tostring(tensor.dtype), 2)
  check(rows[1] >= 0 and rows[2] >= 0 and rows[1] + rows[2] <= tensor.shape[1],
    string.format("register_tensor %s: rows [%d, +%d) outside dim 0 of %d", tensor.name, rows[1], rows[2],
      tensor.shape[1]), 2)
  local pointer, size
  if type(tensor.memory) == "table" then
    pointer, size = tensor.memory.pointer, tensor.memory.size
  else
    pointer, size = tensor.memory:pointer(), tensor.memory:size()
  end
  local row_bytes = row_elements * tonumber(element)
  local offset = tensor.offset or 0
  check(offset + rows[2] * row_bytes <= size, string.format("register_tensor %s: shard runs past its memory",
    tensor.name), 2)
  local entry = {
    name = tensor.name, dtype = tensor.dtype, shape = tensor.shape, rows = rows, row_bytes = row_bytes,
    pointer = ffi.cast("char *", pointer), size = size, offset = offset,
  }
  self.tensors[#self.tensors + 1] = entry
  self.by_name[tensor.name] = entry
end

--- Registers a step callback the host's memory schedule may call by name.
---@param name string
---@param fn fun()
function Agent:register_callback(name, fn)
  check(type(name) == "string" and type(fn) == "function", "register_callback(name, fn)", 2)
  self.callbacks[name] = fn
end

--- Sends the registration; returns when every rank has registered and the
--- host is ready (the rollout runtime started, placed on the ranks' devices).
function Agent:ready()
  local info, message = require("wsync.native.device").query(self.backend, self.device_index)
  if not info then
    errors.raise("AGENT_DEVICE", string.format("rank %d: %s", self.rank, message), { rank = self.rank })
  end
  self.device = { backend = self.backend, index = info.index, uuid = info.uuid, free_bytes = info.free_bytes }
  local tensors = {}
  for i, tensor in ipairs(self.tensors) do
    tensors[i] = { name = tensor.name, dtype = tensor.dtype, shape = tensor.shape, rows = tensor.rows }
  end
  local callbacks = {}
  for name in pairs(self.callbacks) do
    callbacks[#callbacks + 1] = name
  end
  table.sort(callbacks)
  local ok, result = pcall(self.peer.request, self.peer, "register", {
    rank = self.rank, world = self.world, device = self.device, tensors = tensors, callbacks = callbacks,
    hostname = uv.os_gethostname(), pid = uv.os_getpid(),
  }, self.timeout)
  if not ok then
    error(self.aborted or result, 0)
  end
  self.session = result
  return self.session
end

--- Joins a publication (collective: every rank calls it). `step` names the
--- trainer step whose weights these are (every rank must agree). Returns
--- {model_version, publication_id, receipts}; raises the publication's error,
--- the same on every rank, when it fails.
---@param step integer?
---@return table
function Agent:publish(step)
  if self.aborted then
    error(self.aborted, 0)
  end
  local ok, result = pcall(self.peer.request, self.peer, "publish", { rank = self.rank, step = step },
    self.timeout)
  if not ok and self.aborted then
    -- The host said why the session ended before it closed the connection.
    error(self.aborted, 0)
  end
  if not ok then
    if errors.is(result) then
      error(result, 0)
    end
    errors.raise("PUBLISH_FAILED", tostring(result), { rank = self.rank })
  end
  return result
end

-- Host commands -------------------------------------------------------------

function Agent:_init_buffers(payload)
  for _, buffer in ipairs(self.buffers) do
    buffer:close()
  end
  self.buffers = {}
  for slot = 1, payload.count do
    local buffer, message, code = shm.create(payload.bytes)
    if not buffer then
      errors.raise("AGENT_MEMORY", string.format("rank %d cannot allocate packed buffer %d (%d bytes): %s",
        self.rank, slot, payload.bytes, message), { rank = self.rank, phase = "init", cause = code })
    end
    self.buffers[slot] = buffer
  end
  local names = {}
  for slot, buffer in ipairs(self.buffers) do
    names[slot] = buffer:name()
  end
  return { names = names, uuid = self.device.uuid }
end

function Agent:_attach(payload)
  self:_close_targets()
  self.targets = {}
  for rank, names in ipairs(payload.buffers) do
    local per_slot = {}
    for slot, name in ipairs(names) do
      if rank - 1 == self.rank then
        per_slot[slot] = { buffer = self.buffers[slot], own = true }
      else
        local buffer, message = shm.open(name)
        if not buffer then
          errors.raise("AGENT_ATTACH", string.format("rank %d cannot map rank %d's buffer %s: %s", self.rank,
            rank - 1, name, message), { rank = self.rank, phase = "init" })
        end
        per_slot[slot] = { buffer = buffer, own = false }
      end
    end
    self.targets[rank] = per_slot
  end
  return {}
end

function Agent:_begin(payload)
  if self.consumed then
    self.consumed:close()
  end
  self.family = plan_module.family(payload.family)
  self.consumed = assert(manifest_module.new())
  self.publication = payload.publication_id
  return {}
end

-- Copies this rank's rows of each slot of a chunk into buffer `slot` of every
-- rank: one batch of copy ops for all destinations, run in C.
function Agent:_fill(payload)
  if not self.targets then
    errors.raise("AGENT_STATE", "fill before the buffers were attached", { rank = self.rank, phase = "fill" })
  end
  local slots = payload.slots
  local ops = ffi.new("ws_copy_op[?]", #slots)
  local count, source_pointer, source_size = 0, nil, 0
  local bytes = 0
  for _, slot in ipairs(slots) do
    if type(slot) ~= "table" or type(slot.name) ~= "string" or type(slot.offset) ~= "number" or slot.offset < 0
        or slot.offset % 1 ~= 0 then
      errors.raise("BAD_MESSAGE", string.format("rank %d: fill of chunk %d: a slot is not {name, offset}", self.rank,
        payload.chunk), { rank = self.rank, phase = "fill" })
    end
    local tensor = self.by_name[slot.name]
    if not tensor then
      errors.raise("MISSING_TENSOR", string.format("rank %d has no tensor %s registered", self.rank, slot.name),
        { rank = self.rank, phase = "fill" })
    end
    for _, record in ipairs(self.family.export(tensor.name, tensor.shape)) do
      local ok, message = self.consumed:add(record.name, record.dtype, record.shape)
      if not ok then
        errors.raise("MANIFEST", message, { rank = self.rank, phase = "fill" })
      end
    end
    if source_pointer == nil then
      source_pointer, source_size = tensor.pointer, tensor.size
    elseif source_pointer ~= tensor.pointer then
      -- Shards in separate memories: run what is batched so far per source.
      bytes = bytes + self:_run_ops(payload.buffer, ops, count, source_pointer, source_size)
      count, source_pointer, source_size = 0, tensor.pointer, tensor.size
    end
    if tensor.rows[2] > 0 then
      local op = ops[count]
      op.target_offset = slot.offset + tensor.rows[1] * tensor.row_bytes
      op.source_offset = tensor.offset
      op.rows = 1
      op.width = tensor.rows[2] * tensor.row_bytes
      op.target_pitch = op.width
      op.source_pitch = op.width
      count = count + 1
    end
  end
  if count > 0 then
    bytes = bytes + self:_run_ops(payload.buffer, ops, count, source_pointer, source_size)
  end
  return { bytes = bytes, rank = self.rank }
end

-- Runs the ops into buffer `slot` of every rank in one C call, which reads
-- each source byte once (target i of the call is rank i's buffer).
function Agent:_run_ops(slot, ops, count, source_pointer, source_size)
  local world = #self.targets
  local pointers, sizes = ffi.new("void *[?]", world), ffi.new("size_t[?]", world)
  for rank, per_slot in ipairs(self.targets) do
    local target = per_slot[slot].buffer
    pointers[rank - 1], sizes[rank - 1] = ffi.cast("void *", target:pointer()), target:size()
  end
  local status = C.ws_copy_run_targets(pointers, sizes, world, source_pointer, source_size, ops, count)
  if status ~= 0 then
    errors.raise("FILL_FAILED", string.format("rank %d filling buffer %d of every rank (target i is rank i's): %s",
      self.rank, slot, ffi.string(C.ws_error_detail())), { rank = self.rank, phase = "fill" })
  end
  return world * tonumber(C.ws_copy_bytes(ops, count))
end

function Agent:_verify()
  if not self.consumed then
    errors.raise("AGENT_STATE", "verify before begin", { rank = self.rank, phase = "verify" })
  end
  local digest = assert(self.consumed:finish())
  local count, bytes = self.consumed:count(), self.consumed:bytes()
  self.consumed:close()
  self.consumed = nil
  return { manifest = digest, tensors = count, bytes = bytes, rank = self.rank }
end

function Agent:_handlers()
  return {
    init_buffers = function(payload)
      return self:_init_buffers(payload)
    end,
    attach = function(payload)
      return self:_attach(payload)
    end,
    begin = function(payload)
      return self:_begin(payload)
    end,
    fill = function(payload)
      return self:_fill(payload)
    end,
    verify = function()
      return self:_verify()
    end,
    -- The device's memory now (the preflight checks it before buffers exist).
    memory = function()
      local info, message = require("wsync.native.device").query(self.backend, self.device_index)
      if not info then
        errors.raise("AGENT_DEVICE", string.format("rank %d: %s", self.rank, message), { rank = self.rank })
      end
      return { free_bytes = info.free_bytes, total_bytes = info.total_bytes }
    end,
    process_memory = function()
      return require("wsync.util").memory_usage()
    end,
    -- The session ended with a failure; it is this rank's next publish's.
    abort = function(payload)
      local fields = {}
      for key, value in pairs(payload) do
        fields[key] = value
      end
      fields.remote = true
      self.aborted = errors.new(payload.code, payload.message, fields)
      return {}
    end,
    callback = function(payload)
      local fn = self.callbacks[payload.name]
      if not fn then
        errors.raise("UNKNOWN_CALLBACK", string.format("rank %d has no callback '%s'", self.rank,
          tostring(payload.name)), { rank = self.rank, phase = "schedule" })
      end
      fn()
      return {}
    end,
  }
end

function Agent:_close_targets()
  for _, per_slot in ipairs(self.targets or {}) do
    for _, target in ipairs(per_slot) do
      if not target.own then
        target.buffer:close()
      end
    end
  end
  self.targets = nil
end

--- Leaves the host and unmaps and frees every buffer this agent mapped.
function Agent:close()
  self:_close_targets()
  for _, buffer in ipairs(self.buffers) do
    buffer:close()
  end
  self.buffers = {}
  if self.consumed then
    self.consumed:close()
    self.consumed = nil
  end
  self.peer:close("the agent closed")
end

return M
