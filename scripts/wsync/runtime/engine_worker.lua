--- wsync's loader inside another engine's TP worker: the one entry that
--- vLLM's workers call (wsync's worker extension, the direct loader of
--- bindings/python/wsync/vllm/worker/extension.py), through libwsync's embedded host
--- (`worker_command` of wsync.cli.embedded, M.call). One engine worker per
--- process: "open" makes it, "close" drops it, and the rest are the weight
--- commands of wsync.runtime.loader that an engine needs, its info, and
--- `mapped`.
---
--- Memory (M.Memory, the loader's wsync.ResidentMemory): the engine's own
--- parameters, which the Python side lists where they lie now (name ->
--- {pointer, size, dtype, shape}) at init_weights and, unless it says they
--- have not moved, at every start_update; one region per resident tensor.
--- wsync allocates nothing here: the engine sleeps and wakes its parameters,
--- and only the values check reads them back.
local errors = require("wsync.errors")
local loader_module = require("wsync.runtime.loader")
local transport_module = require("wsync.transport")
local device = require("wsync.native.device")

local M = {}

local refuse, fatal = loader_module.refuse, loader_module.fatal

-- The engine's parameters -----------------------------------------------------

---@class wsync.EngineMemory: wsync.ResidentMemory
local Memory = {}
Memory.__index = Memory
M.Memory = Memory -- its methods, for tests

--- The parameters of an engine's TP worker `rank` on device `device` (its
--- index), none bound yet.
---@param options {rank: integer, transport: table, device: integer}
---@return wsync.EngineMemory
function M.memory(options)
  return setmetatable({ rank = options.rank, transport = options.transport, device = options.device }, Memory)
end

-- The strides of a row-major contiguous tensor of `shape`, in elements.
local function row_major(shape)
  local strides, step = {}, 1
  for dim = #shape, 1, -1 do
    strides[dim] = step
    step = step * shape[dim]
  end
  return strides
end

-- An FP8 linear weight whose output width is not a multiple of `alignment`
-- (the init_weights payload's `output_alignment`: the engine says; vLLM's
-- CUTLASS kernel pads a router of 8 experts to 16, wsync.vllm.compat) held
-- padded with zero rows: the [in, out] view of [out_padded, in] row-major
-- storage, the plan's [out, in] bytes at its head. Returns {size = the
-- padded storage's bytes} when `parameter` is `tensor` so padded, else nil
-- (and always nil without an alignment). (Padding of the input width would
-- interleave zeros into every row: not this, and refused as a shape that
-- differs.)
local function padded_view(parameter, tensor, alignment)
  local stride = tensor.stride
  if not alignment or tensor.dtype ~= "float8_e4m3fn" or #tensor.shape ~= 2 or not stride
    or type(parameter.shape) ~= "table" or #parameter.shape ~= 2 or type(parameter.stride) ~= "table" then
    return nil
  end
  local inputs, outputs = tensor.shape[1], tensor.shape[2]
  local padded = math.ceil(outputs / alignment) * alignment
  if parameter.shape[1] ~= inputs or parameter.shape[2] ~= padded or parameter.stride[1] ~= stride[1]
    or parameter.stride[2] ~= stride[2] then
    return nil
  end
  return { size = tensor.bytes / outputs * padded }
end

--- Binds the resident tensors of the loader plan to the engine's parameters
--- (`residents`: name -> {pointer, size, dtype, shape, stride?}, the pointer
--- a number): every tensor the plan fills must be there with its dtype,
--- shape, size and strides (the plan's `stride`, else row-major contiguous;
--- none given: contiguous), and the engine may have no parameter the plan
--- does not fill (it would keep stale weights). An FP8 weight the engine
--- holds padded to its `output_alignment` (padded_view) is bound to the head
--- of its storage. Under quantization "fp8" a missing scale, a weight left
--- bfloat16, or a dense weight that is not the transposed view of [out, in]
--- storage is refused here, named, before anything moves (FP8.md, section 2). The regions change (and a chunk's load
--- plan is made again) only when a parameter moved.
---@param residents table<string, {pointer: number, size: integer, dtype: string, shape: integer[], stride: integer[]?}>
function Memory:_bind(residents)
  if type(residents) ~= "table" then
    fatal("DIRECT_UNSUPPORTED", "no resident parameters were given to the loader")
  end
  local regions, moved = {}, self.regions == nil
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
    local padded = not same_shape and padded_view(parameter, tensor, self.output_alignment)
    if parameter.dtype ~= tensor.dtype or not (same_shape or padded)
      or parameter.size ~= (padded and padded.size or tensor.bytes) then
      fatal("DIRECT_UNSUPPORTED", string.format("TP worker %d: the engine's %s is %s %s (%s bytes); the loader "
        .. "plan fills %s %s (%d bytes)", self.rank, tensor.name, tostring(parameter.dtype),
        require("cjson").encode(parameter.shape or {}), tostring(parameter.size), tensor.dtype,
        require("cjson").encode(tensor.shape), tensor.bytes))
    end
    local strides = tensor.stride or row_major(tensor.shape)
    local same_strides = parameter.stride == nil and tensor.stride == nil
    if parameter.stride ~= nil then
      same_strides = type(parameter.stride) == "table" and #parameter.stride == #strides
      for dim = 1, same_strides and #strides or 0 do
        same_strides = same_strides and parameter.stride[dim] == strides[dim]
      end
    end
    if not same_strides then
      fatal("DIRECT_UNSUPPORTED", string.format("TP worker %d: the engine's %s has strides %s; the loader plan writes "
        .. "it with strides %s%s", self.rank, tensor.name, require("cjson").encode(parameter.stride or "unknown"),
        require("cjson").encode(strides), tensor.stride and " (the [in, out] view of [out, in] row-major storage)"
        or " (row-major, contiguous)"))
    end
    -- (Padded, the plan's bytes are the head of the parameter's storage; the
    -- padding after them is the engine's own, which reaches no output.)
    regions[index] = { pointer = parameter.pointer, size = tensor.bytes, device = self.device }
    local before = self.regions and self.regions[index]
    moved = moved or before == nil or before.pointer ~= parameter.pointer
  end
  for name in pairs(residents) do
    if not self.plan.by_name[name] then
      fatal("DIRECT_UNSUPPORTED", string.format("TP worker %d: the engine's parameter %s is not in the loader plan "
        .. "(it would keep stale weights)", self.rank, name))
    end
  end
  if moved then
    self.regions = regions
  end
end

--- (wsync.ResidentMemory) Binds the residents of `plan` to the parameters
--- the init_weights payload lists (`residents`).
function Memory:bind(plan, payload)
  self.plan = plan
  local alignment = payload.output_alignment
  if alignment ~= nil and (type(alignment) ~= "number" or alignment < 1 or alignment ~= math.floor(alignment)) then
    fatal("DIRECT_UNSUPPORTED", "init_weights: output_alignment must be a positive integer, not "
      .. tostring(alignment))
  end
  self.output_alignment = alignment
  self:_bind(payload.residents)
end

--- (wsync.ResidentMemory) The parameters where they lie now (the
--- start_update payload's `residents`), or word that they lie where they
--- were bound last (`residents_unchanged`).
function Memory:prepare(payload)
  if payload.residents_unchanged == true then
    if not self.regions then
      fatal("DIRECT_UNSUPPORTED", "start_update says the engine's parameters are where they were bound, and "
        .. "none are bound")
    end
  else
    self:_bind(payload.residents)
  end
end

--- (wsync.ResidentMemory) Each resident tensor is its own region: a slice
--- lands in its parameter (`index`, the resident's), at its offset within it.
function Memory:place(slice, index)
  return index, slice.dst - self.plan.tensors[index].offset
end

--- (wsync.ResidentMemory) The parameters' regions, by the plan's index.
function Memory:resident()
  return self.regions
end

--- (wsync.ResidentMemory) Never read back as one memory: they are not one.
function Memory:flat()
  return nil, "the resident tensors are the engine's parameters: this worker does not read them back"
end

--- (wsync.ResidentMemory) The parameters in host memory, laid out as the
--- loader plan lays out one worker's resident storage (the values check
--- reads that layout). Returns the host buffer (close_host_copy closes it),
--- or nil and why.
function Memory:host_copy(plan)
  local copy = require("wsync.native.copy")
  local flat = loader_module.allocate_host(plan.bytes, "host memory for the values check")
  for index, tensor in ipairs(plan.tensors) do
    local host, message = self.transport.host_copy(self.regions[index], self.device)
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

function Memory:close_host_copy(flat)
  flat:close()
end

--- (wsync.ResidentMemory) The engine's, awake as far as wsync knows; no KV
--- arena of wsync's.
function Memory:state()
  return { weights = "awake", kv_cache = "free" }
end

--- (wsync.ResidentMemory) None of wsync's (the engine's parameters: the
--- engine's to say).
function Memory:usage()
  return { device_bytes = 0, host_bytes = 0 }
end

--- (wsync.ResidentMemory) Forgets the parameters (the engine's to free).
function Memory:release()
  self.regions = nil
end

-- The engine's worker -------------------------------------------------------------

---@class wsync.EngineWorker
---@field loader wsync.Loader
local EngineWorker = {}
EngineWorker.__index = EngineWorker
M.EngineWorker = EngineWorker -- its methods, for tests

--- A loader over an engine's parameters (the vllm runtime's worker extension,
--- through libwsync inside that engine's process): no resident memory of its
--- own, no sleep or wake (the engine's), the same weight commands.
---@param options {rank: integer, world: integer, backend: string, device: integer}
---@return wsync.EngineWorker
function M.open(options)
  local info, message = device.query(options.backend, options.device)
  if not info then
    errors.raise("RUNTIME_START", string.format("TP worker %d: device %s:%s: %s", options.rank, options.backend,
      tostring(options.device), message))
  end
  local transport = transport_module.for_backend(options.backend)
  return setmetatable({
    transport = transport,
    loader = loader_module.new({
      rank = options.rank,
      world = options.world,
      device = { backend = options.backend, index = info.index, uuid = info.uuid, name = info.name },
      transport = transport,
      context = { device = info.index },
      memory = M.memory({ rank = options.rank, transport = transport, device = info.index }),
    }),
  }, EngineWorker)
end

--- mapped{buffer}: where this worker's mapping of its rank's packed buffer
--- `buffer` (a slot, 1-based) lies: {pointer, size, device} (the check of the
--- direct loader against the engine's own loader reads the chunk there). The
--- pointer is a decimal string: lua-cjson 2.1 writes numbers with at most 14
--- significant digits, and a device address has 15.
function EngineWorker:mapped(payload)
  local memory = self.loader:buffer(payload.buffer, "mapped")
  if type(memory.region) ~= "function" then
    refuse(string.format("the %s transport's buffers are not device regions", self.transport.NAME))
  end
  local region = memory:region()
  region.pointer = string.format("%.0f", region.pointer)
  return region
end

-- The commands an engine's worker runs beyond open and close: the loader's
-- that an engine needs, and `mapped`.
local COMMANDS = { init_weights = true, start_update = true, load_chunk = true, finish_update = true,
  info = true, resident_values = true, mapped = true }

--- Runs command `cmd` (one of COMMANDS) with `payload`; raises as the
--- command does.
---@param cmd string
---@param payload table
---@return table
function EngineWorker:run(cmd, payload)
  if not COMMANDS[cmd] then
    errors.raise("UNKNOWN_COMMAND", "the embedded worker has no command '" .. tostring(cmd) .. "'")
  end
  if cmd == "mapped" then
    return self:mapped(payload)
  end
  return self.loader[cmd](self.loader, payload)
end

--- Unmaps what the loader holds and forgets the parameters.
function EngineWorker:close()
  self.loader:release_all()
end

local opened = nil -- this process's engine worker, between open and close

--- Runs one command on this process's engine worker and returns its result,
--- or raises its failure (a wsync error; a bug's as WORKER_FAILED, fatal): the
--- entry of an engine's worker extension (bindings/python/wsync/vllm, through
--- ws_host_call's `worker_command`). "open" makes the worker ({rank, world,
--- backend, device}) and answers its info, "close" drops it.
---@param cmd string
---@param payload table
---@return table
function M.call(cmd, payload)
  local ok, result = pcall(function()
    if cmd == "open" then
      if opened then
        opened:close()
      end
      opened = M.open(payload)
      return opened:run("info", {})
    elseif cmd == "close" then
      if opened then
        opened:close()
        opened = nil
      end
      return {}
    end
    if not opened then
      fatal("NOT_INITIALIZED", cmd .. " before the worker was opened")
    end
    return opened:run(cmd, payload)
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

return M
