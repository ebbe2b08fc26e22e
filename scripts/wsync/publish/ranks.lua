--- The trainer ranks of a session, as the host drives them: their
--- registrations, commands to all of them at once, the check of what they
--- registered against the plan (as each registers, and once all have), their packed buffers
--- (created, exported and attached once per session), and chunk fills (a
--- chunk's slots go to the ranks with its first fill; later fills name it).
local errors = require("wsync.errors")
local loop = require("wsync.loop")

local M = {}

---@class wsync.Ranks
---@field agents {peer: wsync.Peer, info: table}[]  by rank, 1-based
---@field descriptors string[][]?  every rank's buffer descriptors, once created
local Ranks = {}
Ranks.__index = Ranks

--- The ranks of `registered` (by rank, 0-based: `{info, peer}`), `world` of
--- them, on a transport that gathers through shared memory or, with
--- `gather = "broadcast"`, by NCCL broadcasts among the ranks (every rank
--- then needs every rank's rows of each slot, and an NCCL unique id).
---@param registered table<integer, {info: table, peer: wsync.Peer}>
---@param world integer
---@param gather "shared"|"broadcast"|nil
---@return wsync.Ranks
function M.new(registered, world, gather)
  local agents = {}
  for rank = 0, world - 1 do
    agents[rank + 1] = { peer = registered[rank].peer, info = registered[rank].info }
  end
  return setmetatable({ agents = agents, fills_planned = {}, broadcasts = gather == "broadcast" and world > 1 },
    Ranks)
end

--- The ranks' device indices and UUIDs, in rank order.
---@return integer[] indices, string[] uuids
function Ranks:devices()
  local indices, uuids = {}, {}
  for index, agent in ipairs(self.agents) do
    indices[index], uuids[index] = agent.info.device.index, agent.info.device.uuid
  end
  return indices, uuids
end

--- Sends `cmd` to every rank at once; returns the results by rank (1-based).
--- Raises the failure of the lowest failing rank, with its rank and the
--- command as the phase.
---@param cmd string
---@param payload_of fun(rank: integer): table
---@param timeout number
function Ranks:all(cmd, payload_of, timeout)
  local agents = self.agents
  local results, failed, err = loop.all(#agents, function(index)
    return agents[index].peer:request(cmd, payload_of(index - 1), timeout)
  end)
  if failed then
    local message = errors.is(err) and err.message or tostring(err)
    errors.raise(errors.is(err) and err.code or "AGENT_FAILED", string.format("trainer rank %d: %s", failed - 1,
      message), { rank = failed - 1, phase = cmd })
  end
  return results
end

local function empty()
  return {}
end

--- Every rank's device memory now: `{free_bytes, total_bytes}` by rank.
---@param timeout number
function Ranks:memory(timeout)
  return self:all("memory", empty, timeout)
end

--- Checks what trainer rank `rank` registered (`tensors`: {name, dtype,
--- shape, rows}) against the plan's trainer layout: every tensor of the
--- layout and no other, each with the plan's dtype and global shape. Raises
--- REGISTER naming the rank and the tensor (the host checks each rank as it
--- registers, and fails the session with it once every rank has registered,
--- before the runtime starts).
---@param plan wsync.Plan
---@param rank integer
---@param tensors table[]
function M.check_tensors(plan, rank, tensors)
  local function refuse(message, tensor)
    errors.raise("REGISTER", message, { rank = rank, tensor = tensor, phase = "registration" })
  end
  local expected = {}
  for _, tensor in ipairs(plan.layout) do
    expected[tensor.name] = tensor
  end
  local registered = {}
  for _, tensor in ipairs(tensors) do
    local want = expected[tensor.name]
    if not want then
      refuse(string.format("trainer rank %d registered %s, which the %s plan does not export", rank, tensor.name,
        plan.family), tensor.name)
    end
    local same = tensor.dtype == want.dtype and #tensor.shape == #want.shape
    for d = 1, #want.shape do
      same = same and tensor.shape[d] == want.shape[d]
    end
    if not same then
      refuse(string.format("trainer rank %d registered %s as %s %s; the model config says %s %s", rank,
        tensor.name, tostring(tensor.dtype), table.concat(tensor.shape, "x"), want.dtype,
        table.concat(want.shape, "x")), tensor.name)
    end
    registered[tensor.name] = true
  end
  for _, tensor in ipairs(plan.layout) do
    if not registered[tensor.name] then
      refuse(string.format("trainer rank %d did not register %s", rank, tensor.name), tensor.name)
    end
  end
end

--- Checks, once per session, that what every rank registered is the plan's
--- trainer layout (M.check_tensors), and the ranks' dim-0 rows covering each
--- tensor exactly once. Raises REGISTER naming the rank and the tensor.
--- (Registrations do not change within a session.)
---@param plan wsync.Plan
function Ranks:check_registration(plan)
  if self.registration_checked == plan then
    return
  end
  local covered = {}
  for index, agent in ipairs(self.agents) do
    local rank = index - 1
    M.check_tensors(plan, rank, agent.info.tensors)
    for _, tensor in ipairs(agent.info.tensors) do
      local rows = covered[tensor.name] or {}
      covered[tensor.name] = rows
      rows[#rows + 1] = { first = tensor.rows[1], count = tensor.rows[2], rank = rank }
    end
  end
  local function refuse(message, fields)
    fields.phase = "registration"
    errors.raise("REGISTER", message, fields)
  end
  for _, tensor in ipairs(plan.layout) do
    local rows = covered[tensor.name]
    table.sort(rows, function(a, b)
      return a.first < b.first
    end)
    local next_row = 0
    for _, range in ipairs(rows) do
      if range.count > 0 then
        if range.first ~= next_row then
          refuse(string.format("%s: rank %d's rows start at %d, expected %d (shards must cover dim 0 exactly once)",
            tensor.name, range.rank, range.first, next_row), { rank = range.rank, tensor = tensor.name })
        end
        next_row = range.first + range.count
      end
    end
    if next_row ~= tensor.shape[1] then
      refuse(string.format("%s: the ranks' shards cover %d of %d rows", tensor.name, next_row, tensor.shape[1]),
        { tensor = tensor.name })
    end
  end
  self.registration_checked = plan
end

--- Creates and exports every rank's packed buffers and has every rank map
--- every rank's, once per session (buffer policy "keep": they live until the
--- session closes). Returns the descriptors by rank, and with `plan.gated`
--- (chunks that may be ordered on the device) every rank's gate.
---@param plan wsync.Plan
---@param timeout number
---@return string[][], string[]?
function Ranks:init_buffers(plan, timeout)
  if plan.direct and not self.descriptors then
    -- One rank, no packed buffers: its storage, exported, and where each
    -- tensor lies in it.
    local result = self:all("init_buffers", function()
      return { count = 1, bytes = 0, direct = true }
    end, timeout)[1]
    if not result.locations then
      errors.raise("AGENT_FAILED", "trainer rank 0 exported its storage without the tensors' locations",
        { rank = 0, phase = "init_buffers" })
    end
    self.descriptors, self.locations, self.attached = { result.names }, result.locations, true
  end
  if not self.descriptors then
    local results = self:all("init_buffers", function()
      return { count = plan.buffer_count, bytes = plan.buffer_bytes, gate = plan.gated or nil }
    end, timeout)
    local descriptors, gates = {}, plan.gated and {} or nil
    for index, result in ipairs(results) do
      descriptors[index] = result.names
      if gates then
        if type(result.gate) ~= "string" then
          errors.raise("AGENT_FAILED", string.format("trainer rank %d made no gate for chunks ordered on the device",
            index - 1), { rank = index - 1, phase = "init_buffers" })
        end
        gates[index] = result.gate
      end
    end
    -- (Chunks ordered on the device: each rank's gate, which its TP worker
    -- maps, and the numbers the fills and loads wait for, counted across
    -- the session's publications.)
    self.gates, self.gate_count = gates, 0
    -- Known before attach: when attach fails, the buffers exist all the same
    -- (and the cleanup removes them).
    self.descriptors = descriptors
  end
  if not self.attached then
    local descriptors = self.descriptors
    local nccl_id = nil
    if self.broadcasts then
      -- One rank makes the NCCL unique id; the host hands it to all.
      nccl_id = self.agents[1].peer:request("nccl_id", {}, timeout).id
    end
    self:all("attach", function()
      return { buffers = descriptors, nccl_id = nccl_id }
    end, timeout)
    self.attached = true
    self.fills_planned = {} -- an attach drops the ranks' fill plans
  end
  return self.descriptors, self.gates
end

-- What the agents get to plan a chunk's fill: its slots' names, offsets and
-- rows (of the trainer tensor) and, when the ranks gather by broadcasts, every
-- rank's rows of each tensor.
function Ranks:_fill_slots(chunk)
  local key = self.broadcasts and "fill_payload_broadcast" or "fill_payload"
  if not chunk[key] then
    local rows_of = {}
    if self.broadcasts then
      for index, agent in ipairs(self.agents) do
        for _, tensor in ipairs(agent.info.tensors) do
          rows_of[tensor.name] = rows_of[tensor.name] or {}
          rows_of[tensor.name][index] = tensor.rows
        end
      end
    end
    local slots = {}
    for i, slot in ipairs(chunk.slots) do
      slots[i] = { name = slot.name, offset = slot.offset, rows = slot.rows, ranks = rows_of[slot.name] }
    end
    chunk[key] = slots
  end
  return chunk[key]
end

--- The direct path's tensor metadata of chunk `k` (once per session): each
--- canonical tensor where it lies in the rank's exported storage (`buffer`:
--- which memory, `offset` in it), for the TP worker to read it from there.
---@param plan wsync.Plan
---@param k integer
function Ranks:direct_tensors(plan, k)
  self.direct_chunks = self.direct_chunks or {}
  if not self.direct_chunks[k] then
    local tensors = {}
    for index, tensor in ipairs(plan.chunks[k].tensors) do
      local location = self.locations[tensor.source]
      if not location then
        errors.raise("PREFLIGHT", string.format("trainer rank 0 gave no location of %s", tensor.source),
          { rank = 0, tensor = tensor.source })
      end
      tensors[index] = { name = tensor.name, dtype = tensor.dtype, shape = tensor.shape, bytes = tensor.bytes,
        source = tensor.source, source_offset = tensor.source_offset, buffer = location.memory,
        offset = location.offset + tensor.source_offset }
    end
    self.direct_chunks[k] = tensors
  end
  return self.direct_chunks[k]
end

--- Every rank fills chunk `k` of `plan` into buffer slot `buffer`; returns
--- their reports once all succeeded (the consensus gate). The chunk's slots
--- go with its first fill of the session: the ranks plan it then, and keep
--- the plan. `fields` go with the fill: `gate` ({after, seq}): chunks
--- ordered on the device, the fill only queued (wsync.transport.cuda_ipc);
--- `begin` ({family, publication_id}), with a publication's first fill: each
--- rank starts the publication then, before it reads anything; `verify`
--- (true), with its last: each rank answers with its consumed manifest too
--- (`consumed`, as it answers verify).
---@param plan wsync.Plan
---@param k integer
---@param buffer integer
---@param timeout number
---@param fields {gate: table?, begin: table?, verify: boolean?}?
function Ranks:fill(plan, k, buffer, timeout, fields)
  fields = fields or {}
  local payload = { chunk = k, buffer = buffer, gate = fields.gate, begin = fields.begin, verify = fields.verify }
  if not self.fills_planned[k] then
    payload.slots = self:_fill_slots(plan.chunks[k])
  end
  local reports = self:all("fill", function()
    return payload
  end, timeout)
  self.fills_planned[k] = true
  return reports
end

--- Chunks ordered on the device: the numbers of a publication of `count`
--- chunks (uint32, cyclic): chunk k's fill writes and its load waits for
--- first + k, and fill k waits for load k - 1's. Returns first.
---@param count integer
---@return integer
function Ranks:gate_numbers(count)
  local first = self.gate_count or 0
  self.gate_count = (first + count) % 2 ^ 32
  return first
end

return M
