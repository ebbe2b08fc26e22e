--- A TP worker of the reference runtime (`wsync runtime-worker`), one process
--- per TP rank as in vLLM's executor. It owns the rank's memory, resident
--- weights and KV arena (M.Memory), and answers the main process over its
--- control channel: the weight commands and their checks through its loader
--- (wsync.runtime.loader, over that memory), sleep, wake, checksum, release
--- and shutdown itself.
---
--- Memory: the resident weights and the KV arena are the backend's device
--- memory, from the transport (wsync.transport: private anonymous memory on
--- the host backend); sleep level 1 moves the weights into a host copy and
--- frees the device copy; level 2 discards them; wake(weights) restores or
--- re-allocates (zeroed). The weights start as deterministic dummy bytes, like
--- vLLM's dummy load format, until a publication writes real ones;
--- init_weights sizes them to the loader plan, one region in its layout.
local errors = require("wsync.errors")
local loader_module = require("wsync.runtime.loader")
local process = require("wsync._process")
local server_module = require("wsync.control.server")
local transport_module = require("wsync.transport")
local util = require("wsync.util")
local device = require("wsync.native.device")

local M = {}

local refuse, fatal = loader_module.refuse, loader_module.fatal

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

local function release(buffer)
  if buffer then
    buffer:close()
  end
  return nil
end

-- The worker's own memory ------------------------------------------------------

---@class wsync.WorkerMemory: wsync.ResidentMemory
local Memory = {}
Memory.__index = Memory
M.Memory = Memory -- its methods, for tests

---@class wsync.WorkerMemoryOptions
---@field rank integer
---@field transport table  the backend's transport (wsync.transport)
---@field context table  {device}, as the transport takes it
---@field weights_bytes integer  the resident weights until a loader plan sizes them
---@field kv_bytes integer

--- The memory of TP worker `rank`: the fields of `options`, awake, nothing
--- allocated yet.
---@param options wsync.WorkerMemoryOptions
---@return wsync.WorkerMemory
function M.memory(options)
  return setmetatable(util.merged(options, { weights_state = "awake" }), Memory)
end

-- Device memory from the transport, its pages backed at once: a
-- publication's loads then take no page fault per page.
function Memory:_allocate(bytes, what)
  local memory, message = self.transport.allocate(bytes, what, self.context)
  if not memory then
    fatal("OUT_OF_MEMORY", string.format("TP worker %d: %s", self.rank, message))
  end
  return memory
end

--- Allocates the resident weights and fills them with the rank's dummy
--- bytes. Returns true, or nil and why the fill failed.
---@return boolean?, string?
function Memory:allocate_dummy()
  self.weights = self:_allocate(self.weights_bytes, "resident weights")
  return self.transport.fill_pattern(self.weights, dummy_pattern(self.rank))
end

function Memory:state()
  return { weights = self.weights_state, kv_cache = self.kv and "reserved" or "free" }
end

function Memory:usage()
  return {
    device_bytes = (self.weights and self.weights:size() or 0) + (self.kv and self.kv:size() or 0),
    host_bytes = self.host_copy_buffer and self.host_copy_buffer:size() or 0,
  }
end

--- Sleeps at `level` (1 or 2): frees the KV arena, and moves the weights to
--- a host copy (1) or discards them (2).
---@param level integer
function Memory:sleep(level)
  self.kv = release(self.kv)
  if self.weights_state == "awake" then
    if level == 1 then
      self.host_copy_buffer = loader_module.allocate_host(self.weights:size(),
        "host memory for the level-1 weight copy")
      copy_host(self.transport, self.weights, self.host_copy_buffer, false, "the level-1 copy of the weights")
      self.weights_state = "offloaded"
    else
      self.weights_state = "discarded"
    end
    self.weights = release(self.weights)
  elseif self.weights_state == "offloaded" and level == 2 then
    self.host_copy_buffer = release(self.host_copy_buffer)
    self.weights_state = "discarded"
  end
end

--- Wakes what `wanted` names ({weights = true, kv_cache = true}): the
--- weights restored from their host copy or allocated again (zeroed), the KV
--- arena allocated (refused while the weights sleep).
---@param wanted {weights: boolean?, kv_cache: boolean?}
function Memory:wake(wanted)
  if wanted.weights and self.weights_state ~= "awake" then
    local weights = self:_allocate(self.weights_bytes, "resident weights")
    if self.weights_state == "offloaded" then
      copy_host(self.transport, weights, self.host_copy_buffer, true, "the weights back from their level-1 copy")
      self.host_copy_buffer = release(self.host_copy_buffer)
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
end

--- The SHA-256 of the whole weights and of the whole KV arena (each nil
--- while not allocated).
---@return string?, string?
function Memory:checksums()
  return self.weights and self.transport.checksum(self.weights, 0, self.weights:size()) or nil,
    self.kv and self.transport.checksum(self.kv, 0, self.kv:size()) or nil
end

--- (wsync.ResidentMemory) Sizes the weights to `plan`: allocated again,
--- zeroed, while awake; else the sleeping copy is dropped (a wake allocates
--- the new size).
function Memory:bind(plan)
  self.weights_bytes = plan.bytes
  if self.weights_state == "awake" then
    self.weights = release(self.weights)
    self.weights = self:_allocate(plan.bytes, "resident weights")
  else
    self.host_copy_buffer = release(self.host_copy_buffer)
    self.weights_state = "discarded"
  end
end

--- (wsync.ResidentMemory) Refuses an update of weights that sleep.
function Memory:prepare()
  if self.weights_state ~= "awake" then
    refuse(string.format("cannot update weights that are %s: wake weights first", self.weights_state))
  end
end

--- (wsync.ResidentMemory) A slice lands at its offset in the plan's layout,
--- in the one region.
function Memory:place(slice)
  return nil, slice.dst
end

--- (wsync.ResidentMemory) The weights, one region in the plan's layout.
function Memory:resident()
  return self.weights
end

--- (wsync.ResidentMemory) The weights, read back as they are.
function Memory:flat()
  return self.weights
end

--- (wsync.ResidentMemory) The weights as host memory (the transport's view
--- or read-back; nothing to give back).
function Memory:host_copy()
  return self.transport.host_copy(self.weights)
end

function Memory:close_host_copy()
end

--- (wsync.ResidentMemory) Frees the weights, their host copy and the KV
--- arena.
function Memory:release()
  self.weights = release(self.weights)
  self.host_copy_buffer = release(self.host_copy_buffer)
  self.kv = release(self.kv)
end

-- The worker --------------------------------------------------------------------

---@class wsync.ReferenceWorker
---@field memory wsync.WorkerMemory
---@field loader wsync.Loader
local Worker = {}
Worker.__index = Worker
M.Worker = Worker -- its methods, for tests

---@class wsync.ReferenceWorkerConfig
---@field rank integer
---@field world integer
---@field device {backend: string, index: integer, uuid: string, name: string?}
---@field weights_bytes integer
---@field kv_bytes integer
---@field transport table?  the backend's (default: wsync.transport.for_backend)

--- The worker of TP rank `rank` of `world` on `device`, its memory and its
--- loader: nothing allocated, no channel (M.main serves one).
---@param options wsync.ReferenceWorkerConfig
---@return wsync.ReferenceWorker
function M.new(options)
  local transport = options.transport or transport_module.for_backend(options.device.backend)
  local context = { device = options.device.index }
  local memory = M.memory({ rank = options.rank, transport = transport, context = context,
    weights_bytes = options.weights_bytes, kv_bytes = options.kv_bytes })
  return setmetatable({
    rank = options.rank,
    memory = memory,
    loader = loader_module.new({ rank = options.rank, world = options.world, device = options.device,
      transport = transport, context = context, memory = memory }),
  }, Worker)
end

function Worker:info()
  return self.loader:info()
end

function Worker:sleep(payload)
  if self.loader:updating() then
    refuse("cannot sleep during a weight update")
  end
  local level = payload.level
  if level ~= 1 and level ~= 2 then
    errors.raise("INVALID_ARGUMENT", "sleep level must be 1 or 2, got " .. tostring(level))
  end
  self.memory:sleep(level)
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
  self.memory:wake(wanted)
  return self:info()
end

--- load_chunk{chunk, buffer, tensors?, gate?, start?, finish?}: the
--- loader's; the first load of an update brings the update's start
--- (`start`: the start_update payload, which the main process did not send
--- on its own), and its last one the finish (`finish`: {publication_id,
--- model_version}, as finish_update's payload): the answer then carries
--- the receipt (`receipt`).
function Worker:load_chunk(payload)
  if payload.start ~= nil then
    self.loader:start_update(payload.start)
  end
  local result = self.loader:load_chunk(payload)
  if payload.finish ~= nil then
    result.receipt = self.loader:finish_update(payload.finish)
  end
  return result
end

function Worker:checksum()
  local weights, kv = self.memory:checksums()
  return { rank = self.rank, weights = weights, kv_cache = kv }
end

--- release{}: the buffers stay mapped (policy "keep"); nothing reads them
--- now.
function Worker:release()
  if self.loader:updating() then
    refuse("release during an update")
  end
  return { rank = self.rank, mapped = self.loader:mapped_count() }
end

-- Unmaps and frees every buffer this worker holds.
function Worker:release_all()
  self.loader:release_all()
end

function Worker:close()
  self:release_all()
  self.server:close()
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
  local self = M.new({
    rank = options.rank,
    world = options.world,
    device = { backend = options.backend, index = info.index, uuid = info.uuid, name = info.name },
    weights_bytes = options.weights_bytes,
    kv_bytes = options.kv_bytes,
  })
  local filled, reason = self.memory:allocate_dummy()
  if not filled then
    errors.raise("RUNTIME_START", string.format("TP worker %d: dummy weights: %s", self.rank, tostring(reason)))
  end

  local handlers = util.method_handlers(self, {
    info = Worker.info, sleep = Worker.sleep, wake = Worker.wake, checksum = Worker.checksum,
    release = Worker.release,
  })
  for _, name in ipairs(loader_module.COMMANDS) do
    handlers[name] = util.bind(self.loader, loader_module.Loader[name])
  end
  handlers.load_chunk = util.bind(self, Worker.load_chunk)
  handlers.process_memory = function()
    return util.memory_usage()
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
