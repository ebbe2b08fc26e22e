--- The agent: wsync's part inside one trainer rank. It registers the rank's
--- tensors (name, dtype, global shape, where its dim-0 shard lives and which
--- rows it holds) and step callbacks, then joins collective publications: on
--- the host's command it creates and exports its packed buffers, runs
--- callbacks, and fills chunks into every rank's buffer through the
--- backend's transport (wsync.transport). Each chunk's fill and its part of
--- the consumed manifest are planned once per session, at the chunk's first
--- fill; a publication then runs one transport call per chunk.
---
--- Everything here runs in coroutines on the host loop of the trainer's own
--- wsync host (the synthetic trainer, or libwsync embedded in a trainer).
local ffi = require("ffi")
local uv = require("luv")
local chunk_plans_module = require("wsync.transport.chunk_plans")
local copy = require("wsync.native.copy")
local dtype_module = require("wsync.native.dtype")
local errors = require("wsync.errors")
local loop = require("wsync.loop")
local manifest_module = require("wsync.native.manifest")
local messages = require("wsync.control.messages")
local peer_module = require("wsync.control.peer")
local plan_module = require("wsync.plan")
local transport_module = require("wsync.transport")

local M = {}

---@class wsync.Agent
---@field rank integer
---@field world integer
---@field host_pid integer?  the host's pid, when the endpoint is its own socket
local Agent = {}
Agent.__index = Agent

--- True when this process is a child of the host it publishes to (the
--- host's synthetic trainer ranks): the host prints the session's failure in
--- its verdict, so the rank need not print it again.
---@return boolean
function Agent:started_by_host()
  local parent = uv.os_getppid()
  if self.host_pid then
    return self.host_pid == parent
  end
  -- (An endpoint the recipe named, control.endpoint or control.tcp: the
  -- host that started this rank marked it for its guard with its own pid,
  -- WSYNC_GUARD_MARK=<host pid>-<random>.)
  local mark = os.getenv(require("wsync.control.guard").VARIABLE) or ""
  return tonumber(mark:match("^(%d+)%-")) == parent
end

local function check(condition, message, level)
  if not condition then
    error(message, (level or 1) + 1)
  end
end

---@class wsync.AgentOptions
---@field endpoint string?  default: $WSYNC_ENDPOINT
---@field rank integer
---@field world integer
---@field backend string?
---@field device_index integer?
---@field timeout number?

--- The endpoint a rank connects to when it is given none: $WSYNC_ENDPOINT
--- (a launcher sets it for every rank).
M.ENDPOINT_VARIABLE = "WSYNC_ENDPOINT"

--- Where a rank finds the token of a TCP endpoint that does not carry one
--- (`tcp://ADDRESS:PORT`, a recipe's control.token_env or token_file): the
--- token itself, or a file that holds it.
M.TOKEN_VARIABLE, M.TOKEN_FILE_VARIABLE = "WSYNC_TOKEN", "WSYNC_TOKEN_FILE"

-- The token of a TCP endpoint without one, from $WSYNC_TOKEN or the file
-- $WSYNC_TOKEN_FILE names; raises AGENT_CONNECT naming them when neither is.
local function token_from_environment(rank, endpoint)
  local token = os.getenv(M.TOKEN_VARIABLE)
  if token and token ~= "" then
    return token
  end
  local path = os.getenv(M.TOKEN_FILE_VARIABLE)
  if path and path ~= "" then
    local text, message = require("wsync.util").read_file(path)
    if not text then
      errors.raise("AGENT_CONNECT", string.format("rank %d: cannot read the token of %s from %s (%s): %s", rank,
        endpoint, path, M.TOKEN_FILE_VARIABLE, tostring(message)), { rank = rank })
    end
    return text:match("^%s*(.-)%s*$")
  end
  errors.raise("AGENT_CONNECT", string.format("rank %d: %s carries no token, and neither %s nor %s is set: give "
    .. "the host's token (its recipe's control.token_env or control.token_file says where it is)", rank, endpoint,
    M.TOKEN_VARIABLE, M.TOKEN_FILE_VARIABLE), { rank = rank })
end

--- Connects to the host's control endpoint: `options.endpoint`, or
--- $WSYNC_ENDPOINT. A unix socket path, or `tcp://ADDRESS:PORT?token=TOKEN`
--- (`tcp://ADDRESS:PORT`: the token from $WSYNC_TOKEN or the file
--- $WSYNC_TOKEN_FILE names). Must run in a spawned coroutine.
---@param options wsync.AgentOptions
---@return wsync.Agent
function M.connect(options)
  check(options.endpoint == nil or type(options.endpoint) == "string",
    "agent.connect: endpoint must be a socket path or tcp://ADDRESS:PORT", 2)
  check(type(options.rank) == "number" and type(options.world) == "number" and options.rank >= 0
    and options.rank < options.world, "agent.connect: rank must be in [0, world)", 2)
  local endpoint = options.endpoint
  if endpoint == nil then
    endpoint = os.getenv(M.ENDPOINT_VARIABLE)
    if endpoint == nil or endpoint == "" then
      errors.raise("AGENT_CONNECT", string.format("rank %d: no endpoint given and %s is not set: set it to the "
        .. "host's control endpoint (the socket path `wsync run` prints, or its recipe's control.endpoint)",
        options.rank, M.ENDPOINT_VARIABLE), { rank = options.rank })
    end
  end
  local self = setmetatable({
    rank = options.rank,
    world = options.world,
    backend = options.backend or "host",
    device_index = options.device_index or options.rank,
    timeout = options.timeout or 600,
    tensors = {},
    by_name = {},
    callbacks = {},
    memories = {},      -- the objects holding the shards, each once
    memory_index = {},  -- memory object -> its index in memories
    own = nil,          -- this rank's packed buffers (transport)
    targets = nil,      -- every rank's buffers, as this rank fills them
  }, Agent)
  self.transport = transport_module.for_backend(self.backend)
  -- By chunk: {plan, segment, tensors}, once per session; the segments make
  -- the consumed manifest.
  self.fill_plans = chunk_plans_module.new(self.transport)
  self.endpoint = endpoint
  -- A unix socket path, or "tcp://ADDRESS:PORT?token=TOKEN" for a host in
  -- another network namespace (the token is the connection's first request).
  local address, port, token = endpoint:match("^tcp://%[?([^%]/]-)%]?:(%d+)%?token=([%w%-%._~]+)$")
  if not address then
    address, port = endpoint:match("^tcp://%[?([^%]/]-)%]?:(%d+)$")
  end
  if endpoint:match("^tcp://") and not address then
    errors.raise("AGENT_CONNECT", string.format("rank %d: %s is not tcp://ADDRESS:PORT?token=TOKEN (the host "
      .. "prints it)", self.rank, endpoint), { rank = self.rank })
  end
  if address and not token then
    token = token_from_environment(self.rank, endpoint)
  end
  local pipe = address and uv.new_tcp() or uv.new_pipe(false)
  local connected, message = loop.await(function(resume)
    local function done(err)
      resume(err == nil, err)
    end
    if address then
      pipe:connect(address, tonumber(port), done)
    else
      pipe:connect(endpoint, done)
    end
  end)
  if not connected then
    pipe:close()
    errors.raise("AGENT_CONNECT", string.format("rank %d cannot connect to %s: %s", self.rank,
      endpoint:gsub("%?token=.*$", ""), tostring(message)), { rank = self.rank })
  end
  self.pipe = pipe
  -- How errors name the host: its endpoint without the token, and its pid
  -- when the endpoint is a host's own socket (wsync-<pid>-XXXXXX/).
  local host_pid = endpoint:match("/wsync%-(%d+)%-%w+/[^/]*$")
  self.host_pid = tonumber(host_pid)
  self.host_name = string.format("the wsync host at %s%s", endpoint:gsub("%?token=.*$", ""),
    host_pid and (" (pid " .. host_pid .. ")") or "")
  self.peer = peer_module.new(pipe, {
    name = "host",
    handlers = self:_handlers(),
    schemas = { requests = messages.to_agent, results = messages.from_host },
    on_close = function(reason)
      self.lost = reason
    end,
  })
  if token then
    -- (Until the host has its answer, it takes nothing else from this
    -- connection, and only small frames.)
    local ok, err = pcall(self.peer.request, self.peer, "hello", { token = token }, self.timeout)
    if not ok then
      self.peer:close("refused")
      local host = address:find(":", 1, true) and ("[" .. address .. "]") or address
      errors.raise("AGENT_CONNECT", string.format("rank %d: the host at tcp://%s:%s did not take this connection: %s",
        self.rank, host, port, tostring(err)), { rank = self.rank })
    end
  end
  return self
end

--- Lets the loop end (wsync.loop.run) while this agent stays connected: for
--- a trainer that runs the host loop only inside its own calls (libwsync's
--- agent API), so that the host's other work does not wait on the connection.
--- The connection is still served whenever the loop runs.
function Agent:unref()
  self.pipe:unref()
end

--- Registers one tensor. `memory` is a wsync.native.shm buffer (or
--- `{pointer = lightuserdata, size = bytes}`) holding this rank's rows
--- [first, first + count) of dim 0, row-major, from byte `offset`. The agent
--- keeps `memory` referenced for as long as it lives, and reads its pointer
--- again at every publication's start.
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
  local element = dtype_module.size(tensor.dtype)
  check(element ~= nil, "register_tensor: unknown dtype " .. tostring(tensor.dtype), 2)
  check(rows[1] >= 0 and rows[2] >= 0 and rows[1] + rows[2] <= tensor.shape[1],
    string.format("register_tensor %s: rows [%d, +%d) outside dim 0 of %d", tensor.name, rows[1], rows[2],
      tensor.shape[1]), 2)
  check(tensor.memory ~= nil, "register_tensor " .. tensor.name .. ": memory required", 2)
  local _, size = copy.view(tensor.memory)
  local row_bytes = row_elements * element
  local offset = tensor.offset or 0
  check(offset + rows[2] * row_bytes <= size, string.format("register_tensor %s: shard runs past its memory",
    tensor.name), 2)
  local source = self.memory_index[tensor.memory]
  if not source then
    self.memories[#self.memories + 1] = tensor.memory
    source = #self.memories
    self.memory_index[tensor.memory] = source
  end
  local entry = {
    name = tensor.name, dtype = tensor.dtype, shape = tensor.shape, rows = rows, row_bytes = row_bytes,
    memory = tensor.memory, source = source, offset = offset,
  }
  self.tensors[#self.tensors + 1] = entry
  self.by_name[tensor.name] = entry
end

--- Tells the agent that tensor `name`'s rows now live at `pointer`, `size`
--- bytes (lightuserdata or cdata), after an offload and an onload moved its
--- storage: for a tensor registered with a `{pointer, size}` table, which is
--- updated in place (tensors registered on the same table move together).
--- Read at the next publication's start, like every pointer. Allowed at any
--- time outside a fill, step callbacks included. A NULL pointer with size 0
--- says the rows are not in memory now (offloaded): a publication that
--- starts so fails, naming the tensor, instead of reading freed memory.
---@param name string
---@param pointer any
---@param size integer
function Agent:move_tensor(name, pointer, size)
  local entry = self.by_name[name]
  check(entry ~= nil, "move_tensor: no tensor " .. tostring(name) .. " is registered", 2)
  local memory = entry.memory
  check(type(memory) == "table" and getmetatable(memory) == nil and memory.size ~= nil,
    "move_tensor " .. name .. ": it was registered on a memory object, not on a {pointer, size} table", 2)
  local null = pointer == nil or ffi.cast("void *", pointer) == nil
  if null and size == 0 then
    memory.pointer, memory.size = nil, 0
    return
  end
  check(entry.rows[2] == 0 or not null, "move_tensor " .. name .. ": the pointer is NULL (with size 0: not in "
    .. "memory now)", 2)
  local needed = entry.offset + entry.rows[2] * entry.row_bytes
  check(type(size) == "number" and size >= needed, string.format("move_tensor %s: %s bytes do not hold its %d rows "
    .. "(%d bytes)", name, tostring(size), entry.rows[2], needed), 2)
  memory.pointer, memory.size = pointer, size
end

--- Registers a step callback the host's memory schedule may call by name.
---@param name string
---@param fn fun()
function Agent:register_callback(name, fn)
  check(type(name) == "string" and type(fn) == "function", "register_callback(name, fn)", 2)
  self.callbacks[name] = fn
end

--- Says, from inside a step callback, how many bytes it moved (the run
--- report's bytes of that step, added up over the ranks); outside one it
--- is forgotten.
---@param bytes integer
function Agent:report_moved(bytes)
  check(type(bytes) == "number" and bytes >= 0 and bytes == math.floor(bytes), "report_moved(bytes)", 2)
  self.moved_bytes = bytes
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
    error(self.aborted or self:_host_lost(result, "register"), 0)
  end
  self.session = result
  return self.session
end

--- Joins a publication (collective: every rank calls it). `step` names the
--- trainer step whose weights these are (every rank must agree). Returns
--- {model_version, publication_id, receipts, report, generation?}; raises the
--- publication's error, the same on every rank, when it fails. `generate`
--- ({prompts, sampling?}): what the schedule's "generate" step generates for
--- this rank with the weights just published (its outputs in `generation`,
--- JSON text).
---@param step integer?
---@param generate {prompts: integer[][], sampling: table?}?
---@return table
function Agent:publish(step, generate)
  if self.aborted then
    error(self.aborted, 0)
  end
  local ok, result = pcall(self.peer.request, self.peer, "publish", { rank = self.rank, step = step,
    generate = generate }, self.timeout)
  if not ok then
    -- (A failed publication destroyed its runtime: fills it left queued on
    -- the device behind its loads run now, before the trainer goes on and
    -- its next device-wide synchronization would wait for them.)
    pcall(self._release_gate, self)
  end
  if not ok and self.aborted then
    -- The host said why the session ended before it closed the connection.
    error(self.aborted, 0)
  end
  if not ok then
    if errors.is(result) then
      error(self:_host_lost(result, "publish"), 0)
    end
    errors.raise("PUBLISH_FAILED", tostring(result), { rank = self.rank })
  end
  return result
end

-- The error of a call whose connection to the host ended before its answer
-- (PEER_LOST of this end: EOF, a broken connection, a timeout): HOST_LOST
-- naming the host, what ended it and the call; any other error (the host's
-- own, a lost peer of the host's included) as it is.
function Agent:_host_lost(err, call)
  if not errors.is(err) or err.code ~= "PEER_LOST" or err.remote then
    return err
  end
  local cause = tostring(self.peer.cause or err.message)
  local gone = cause == "host closed the connection" and "closed the connection (it ended the session, or is gone)"
    or cause:match("^timeout") and ("did not answer in time (" .. cause .. ")")
    or ("is gone (" .. cause:gsub("^host: ", "") .. ")")
  return errors.new("HOST_LOST", string.format("rank %d: %s %s during %s; this rank's session has ended", self.rank,
    self.host_name, gone, call), { rank = self.rank, phase = err.phase or call })
end

-- Host commands -------------------------------------------------------------

-- Raises `code` for this rank in `phase` with `message` (and the transport's
-- status code as the cause).
local function refuse(self, code, phase, message, cause)
  errors.raise(code, string.format("rank %d: %s", self.rank, message), { rank = self.rank, phase = phase,
    cause = cause })
end

-- Chunks ordered on the device (wsync.transport.cuda_ipc): when fills were
-- queued behind its TP worker's loads and the publication did not end (its
-- verify settles them), the worker will not load again (it was destroyed
-- with the publication): this rank writes the gate itself, so that its
-- stream runs the queued fills, and waits for them.
function Agent:_release_gate()
  if not self.gate_waits then
    return
  end
  local after = self.gate_waits
  self.gate_waits = nil
  local ok, message, code = self.transport.release_gate(self.targets, after)
  if not ok then
    refuse(self, "AGENT_DEVICE", "abort", "cannot release the fills queued on the device: " .. tostring(message), code)
  end
end

-- Drops what the packed buffers of an earlier session left: mappings, the
-- rank's own buffers, the chunks' fill plans.
function Agent:_release_buffers()
  self:_release_gate()
  self.transport.release(self.own, self.targets)
  self.own, self.targets, self.direct = nil, nil, nil
  self.fill_plans:clear()
end

function Agent:_init_buffers(payload)
  self:_release_buffers()
  if payload.direct then
    return self:_export_storage()
  end
  if payload.gate and not transport_module.can(self.transport, "gates") then
    refuse(self, "AGENT_STATE", "init", "the " .. self.transport.NAME .. " transport cannot order chunks on the device")
  end
  local own, message, code = self.transport.create(payload.count, payload.bytes,
    { device = self.device_index, gate = payload.gate })
  if not own then
    refuse(self, "AGENT_MEMORY", "init", "cannot create its packed buffers: " .. message, code)
  end
  self.own = own
  return { names = self.transport.descriptors(own), uuid = self.device.uuid,
    gate = payload.gate and self.transport.gate_descriptor(own) or nil }
end

-- The direct path (one rank): no packed buffers; the rank's own storage is
-- exported for the TP worker to read, with where each tensor lies in it.
function Agent:_export_storage()
  if not transport_module.can(self.transport, "direct") then
    refuse(self, "AGENT_STATE", "init", "the " .. self.transport.NAME .. " transport has no direct path")
  end
  local names, offsets, code = self.transport.export_memories(self.memories, self.device_index)
  if not names then
    refuse(self, "AGENT_MEMORY", "init", "cannot export its storage: " .. tostring(offsets)
      .. " (packed buffers serve any storage: buffers.direct = false)", code)
  end
  local locations = {}
  for _, tensor in ipairs(self.tensors) do
    -- (Where the tensor lies in what its memory's descriptor maps: storage
    -- allocated elsewhere is exported as its whole allocation.)
    locations[tensor.name] = { memory = tensor.source, offset = offsets[tensor.source] + tensor.offset }
  end
  self.direct = self:_pointer_signature()
  return { names = names, uuid = self.device.uuid, locations = locations }
end

function Agent:_attach(payload)
  if not self.own then
    refuse(self, "AGENT_STATE", "init", "attach before its buffers were created")
  end
  self.transport.release(nil, self.targets) -- mappings of an attach before
  self.targets = nil
  local targets, message, code = self.transport.attach(self.own, payload.buffers, self.rank,
    { world = self.world, nccl_id = payload.nccl_id })
  if not targets then
    refuse(self, "AGENT_ATTACH", "init", "cannot map the ranks' buffers: " .. message, code)
  end
  self.targets = targets
  self.fill_plans:clear()
  return {}
end

-- Starts a publication on this rank (the `begin` of its first fill:
-- {family, publication_id}): a new consumed manifest, and the shards'
-- pointers read where they are now.
function Agent:_begin(payload)
  self:_release_gate() -- (fills queued by a publication that failed)
  local family = plan_module.family(payload.family)
  if self.family and self.family ~= family then
    self.fill_plans:clear() -- another family's export makes other records
  end
  self.family = family
  -- The chunks this publication fills, in order: the consumed manifest is
  -- the manifest of their segments (wsync.native.manifest.digest_cache).
  self.consumed = {}
  self.publication = payload.publication_id
  -- The shards' pointers as they are now: memory moved by an offload and an
  -- onload since the last publication is read where it is (and a plan that
  -- holds addresses is made again).
  for _, tensor in ipairs(self.tensors) do
    if tensor.rows[2] > 0 and type(tensor.memory) == "table" and getmetatable(tensor.memory) == nil
        and tensor.memory.pointer == nil then
      refuse(self, "TENSOR_UNAVAILABLE", "begin", string.format("tensor %s is not in memory at the publication's "
        .. "start (offloaded, and no schedule step before \"publish\" brought it back)", tensor.name))
    end
  end
  self.sources = self.transport.sources(self.memories, self.device_index)
  self.signature = self:_pointer_signature()
  if self.direct and self.direct ~= self.signature then
    -- The TP worker maps the storage exported at the session's start: it
    -- would read memory this rank no longer uses.
    refuse(self, "STORAGE_MOVED", "begin", "its tensors' storage moved since the direct path exported it at the "
      .. "session's start; the direct path needs storage that stays in place (use packed buffers: "
      .. "buffers.direct = false)")
  end
  return {}
end

-- Every memory's pointer as it is now, as one string.
function Agent:_pointer_signature()
  local pointers = {}
  for index, memory in ipairs(self.memories) do
    pointers[index] = tostring((copy.view(memory)))
  end
  return table.concat(pointers, ",")
end

-- The NCCL unique id the host hands to every rank (several ranks on cuda).
function Agent:_nccl_id()
  local id, message, code = self.transport.nccl_id()
  if not id then
    refuse(self, "AGENT_NCCL", "init", "cannot make an NCCL unique id: " .. tostring(message), code)
  end
  return { id = id }
end

-- Plans chunk `k`'s fill from its slots (`{name, offset, rows?, ranks?}`:
-- the trainer tensors in the chunk, where each starts in the buffer, which of
-- its rows the chunk holds (`{first, count}`; all when absent) and, with
-- several ranks on a transport that gathers by broadcasts, every rank's
-- `{first, count}` rows of the tensor): this rank's rows of each in the chunk
-- (`spans`), every rank's (`roots`), and the canonical records the export
-- makes of those rows (the chunk's part of the consumed manifest). The
-- transport's own plan is made at the first fill (M._fill).
function Agent:_plan_fill(k, slots)
  local spans, roots, segment = {}, {}, assert(manifest_module.segment())
  manifest_module.fill_segment(segment, function()
    for _, slot in ipairs(slots) do
      if type(slot) ~= "table" or type(slot.name) ~= "string" or type(slot.offset) ~= "number" or slot.offset < 0
          or slot.offset % 1 ~= 0 then
        refuse(self, "BAD_MESSAGE", "fill", string.format("fill of chunk %d: a slot is not {name, offset}", k))
      end
      local tensor = self.by_name[slot.name]
      if not tensor then
        refuse(self, "MISSING_TENSOR", "fill", "has no tensor " .. slot.name .. " registered")
      end
      local first, count = 0, tensor.shape[1]
      if slot.rows ~= nil then
        first, count = slot.rows[1], slot.rows[2]
        if type(first) ~= "number" or type(count) ~= "number" or first < 0 or count < 1 or first % 1 ~= 0
            or count % 1 ~= 0 or first + count > tensor.shape[1] then
          refuse(self, "BAD_MESSAGE", "fill", string.format("fill of chunk %d: rows %s of %s, which has %d", k,
            require("cjson").encode(slot.rows), slot.name, tensor.shape[1]))
        end
      end
      local low, high = first * tensor.row_bytes, (first + count) * tensor.row_bytes
      for _, record in ipairs(self.family.export(tensor.name, tensor.shape)) do
        if record.offset >= low and record.offset < high then
          local added, message = segment:add(record.name, record.dtype, record.shape)
          if not added then
            refuse(self, "MANIFEST", "fill", message)
          end
        end
      end
      -- A shard's rows {at, n} within the chunk's: where they go in the buffer,
      -- where they start in the shard, how many bytes; nil when none are.
      local function within(at, n)
        local a, b = math.max(at, first), math.min(at + n, first + count)
        if b <= a then
          return nil
        end
        return slot.offset + (a - first) * tensor.row_bytes, (a - at) * tensor.row_bytes, (b - a) * tensor.row_bytes
      end
      local target, skip, bytes = within(tensor.rows[1], tensor.rows[2])
      if target then
        spans[#spans + 1] = { target_offset = target, source = tensor.source, source_offset = tensor.offset + skip,
          bytes = bytes }
      end
      for index, rows in ipairs(type(slot.ranks) == "table" and slot.ranks or {}) do
        roots[index] = roots[index] or {}
        if type(rows) == "table" and (rows[2] or 0) > 0 then
          local own = index - 1 == self.rank
          target, skip, bytes = within(rows[1], rows[2])
          if target then
            roots[index][#roots[index] + 1] = { target_offset = target, bytes = bytes,
              source = own and tensor.source or nil, source_offset = own and tensor.offset + skip or nil }
          end
        end
      end
    end
  end)
  local fill = { spans = spans, roots = roots, segment = segment, tensors = #slots }
  self.fill_plans:put(k, fill)
  return fill
end

-- The fill of chunk `payload.chunk`: planned anew when the payload brings the
-- chunk's slots (its first fill after attach; the plan before is closed),
-- else the one planned before. Returns the chunk and its fill.
function Agent:_chunk_fill(payload)
  local k = payload.chunk
  local fill = self.fill_plans:get(k)
  if payload.slots ~= nil then
    fill = self:_plan_fill(k, payload.slots) -- (closes the one before)
  elseif not fill then
    refuse(self, "BAD_METADATA", "fill", string.format("chunk %d comes without its slots, and none came before", k))
  end
  return k, fill
end

-- Fills chunk `k` into buffer slot `payload.buffer` of every rank: one
-- transport call. A chunk's slots come with its first fill after attach;
-- later fills name the chunk only. A publication's first fill brings its
-- `begin`, which starts it here before anything is read; its last may ask
-- for the consumed manifest (`verify`), which the answer then carries
-- (`consumed`, as verify answers it).
function Agent:_fill(payload)
  if payload.begin ~= nil then
    self:_begin(payload.begin)
  end
  if payload.verify and payload.gate then
    refuse(self, "BAD_MESSAGE", "fill", "a fill ordered on the device is only queued: its consumed manifest comes "
      .. "with verify, once the loads ran")
  end
  if self.direct and self.consumed then
    -- The direct path: nothing to copy (the TP worker reads this rank's
    -- storage); the chunk's records still make the consumed manifest.
    local k = self:_chunk_fill(payload)
    self.consumed[#self.consumed + 1] = k
    return { bytes = 0, rank = self.rank, copy_seconds = 0, consumed = payload.verify and self:_consumed() or nil }
  end
  if not self.targets or not self.consumed then
    refuse(self, "AGENT_STATE", "fill", "fill before the buffers were attached and the publication began")
  end
  local k, fill = self:_chunk_fill(payload)
  if not fill.plan or (self.transport.BINDS_MEMORY and (fill.slot ~= payload.buffer
      or fill.signature ~= self.signature)) then
    self.transport.close_plan(fill.plan)
    local plan, message, code = self.transport.plan_fill(self.targets, payload.buffer, self.sources, fill.spans,
      { roots = fill.roots, world = self.world })
    if not plan then
      refuse(self, "FILL_FAILED", "fill", string.format("cannot plan the fill of chunk %d: %s", k, tostring(message)),
        code)
    end
    fill.plan, fill.slot, fill.signature = plan, payload.buffer, self.signature
  end
  -- (payload.gate: chunks ordered on the device; the fill is only queued,
  -- and this rank's verify waits for it.)
  local gate = payload.gate
  local bytes, seconds, code = self.transport.fill(self.targets, payload.buffer, self.sources, fill.plan,
    string.format("filling buffer %d of every rank", payload.buffer), gate)
  if gate and bytes then
    self.gate_waits = gate.after or self.gate_waits or 0
  end
  if not bytes then
    refuse(self, "FILL_FAILED", "fill", seconds, code)
  end
  self.consumed[#self.consumed + 1] = k
  return { bytes = bytes, rank = self.rank, copy_seconds = seconds,
    consumed = payload.verify and self:_consumed() or nil }
end

-- The publication's consumed manifest (the manifest of the chunks this rank
-- filled, in order), as verify answers it; the publication ends here.
function Agent:_consumed()
  local manifest, message = self.fill_plans:manifest(self.consumed)
  self.consumed = nil
  if not manifest then
    refuse(self, "MANIFEST", "verify", message)
  end
  return { manifest = manifest.digest, tensors = manifest.count, bytes = manifest.bytes, rank = self.rank }
end

function Agent:_verify()
  if not self.consumed then
    refuse(self, "AGENT_STATE", "verify", "verify before begin")
  end
  if self.gate_waits then
    -- (The fills ordered on the device: the host asks only once the TP
    -- worker's last load finished, so they have.)
    self.gate_waits = nil
    local ok, message, code = self.transport.settle(self.device_index)
    if not ok then
      refuse(self, "FILL_FAILED", "verify", "the fills queued on the device failed: " .. tostring(message), code)
    end
  end
  return self:_consumed()
end

-- The values check (wsync.plan.values): what this rank's rows add to every
-- resident tensor of every TP worker, read from its memories (host memory).
function Agent:_values_sums(payload)
  local key = payload.family .. " " .. require("cjson").encode(payload.config)
  local cached = self.values_plan
  if not cached or cached.key ~= key or cached.tp ~= payload.tp then
    local family = plan_module.family(payload.family)
    local plan = plan_module.build({ family = payload.family, config = payload.config }, { bytes = 2 ^ 52, count = 1 })
    local loaders = {}
    for w = 1, payload.tp do
      loaders[w] = family.loader_plan(plan.config, payload.tp, w - 1)
    end
    cached = { key = key, tp = payload.tp, plan = plan, loaders = loaders }
    self.values_plan = cached
  end
  local values = require("wsync.plan.values")
  -- The shards in host memory (read back from the device on cuda).
  local memories = {}
  for index, memory in ipairs(self.memories) do
    local host, message, code = self.transport.host_copy(memory, self.device_index)
    if not host then
      refuse(self, "VALUES_FAILED", "values check", string.format("memory %d: %s", index, tostring(message)), code)
    end
    memories[index] = host
  end
  local workers = {}
  for w, loader in ipairs(cached.loaders) do
    local ok, sums = pcall(values.trainer, loader, cached.plan, self.by_name, memories)
    if not ok then
      refuse(self, errors.is(sums) and sums.code or "VALUES_FAILED", "values check", errors.is(sums) and sums.message
        or tostring(sums))
    end
    workers[w] = sums
  end
  return { workers = workers }
end

function Agent:_handlers()
  local util = require("wsync.util")
  local handlers = util.method_handlers(self, {
    init_buffers = Agent._init_buffers, attach = Agent._attach, fill = Agent._fill,
    verify = Agent._verify, nccl_id = Agent._nccl_id, values_sums = Agent._values_sums,
  })
  -- The device's memory now (the preflight checks it before buffers exist).
  handlers.memory = function()
    local info, message = require("wsync.native.device").query(self.backend, self.device_index)
    if not info then
      errors.raise("AGENT_DEVICE", string.format("rank %d: %s", self.rank, message), { rank = self.rank })
    end
    return { free_bytes = info.free_bytes, total_bytes = info.total_bytes }
  end
  handlers.process_memory = function()
    return util.memory_usage()
  end
  -- The session ended with a failure; it is this rank's next publish's.
  handlers.abort = function(payload)
    self.aborted = errors.new(payload.code, payload.message, util.merged(payload, { remote = true }))
    self:_release_gate()
    return {}
  end
  handlers.callback = function(payload)
    local fn = self.callbacks[payload.name]
    if not fn then
      errors.raise("UNKNOWN_CALLBACK", string.format("rank %d has no callback '%s'", self.rank,
        tostring(payload.name)), { rank = self.rank, phase = "schedule" })
    end
    self.moved_bytes = nil
    fn()
    local moved = self.moved_bytes
    self.moved_bytes = nil
    return { bytes = moved }
  end
  return handlers
end

--- Leaves the host and unmaps and frees every buffer this agent mapped.
function Agent:close()
  self:_release_buffers()
  self.consumed = nil
  self.peer:close("the agent closed")
end

return M
