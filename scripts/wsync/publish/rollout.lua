--- One spawned rollout runtime, as a session owns it: its client (the
--- control channel and the process tree), what it said about itself at
--- startup, whether its weights were initialized (its TP workers imported the
--- packed buffers and sized their resident storage), which chunks' tensor
--- metadata it has, and whether a failed publication destroyed it. A session
--- that respawns makes a new one; a destroyed one is never used again.
--- M.start spawns the one a recipe asks for (several replicas: a ReplicaSet).
local console = require("wsync.publish.console")
local errors = require("wsync.errors")
local util = require("wsync.util")
local plan_module = require("wsync.plan")
local runtime_module = require("wsync.runtime")

local M = {}

---@class wsync.Rollout
---@field client wsync.RuntimeClient
---@field info table            the runtime's answer to `info` at startup
---@field initialized boolean   init_weights done
---@field poisoned wsync.Error? why a failed publication destroyed it
local Rollout = {}
Rollout.__index = Rollout
M.Rollout = Rollout -- its methods, for tests

--- Spawns a runtime (wsync.runtime.spawn's options) and asks for its info.
--- Raises RUNTIME_START when it does not start.
---@param options table
---@return wsync.Rollout
function M.spawn(options)
  local client = runtime_module.spawn(options)
  local self = setmetatable({ client = client, initialized = false, chunks_sent = {} }, Rollout)
  self.info = client:info()
  return self
end

--- Sends a command and returns its result (wsync.control.client's rules:
--- a failed weight, sleep or wake command breaks it).
---@param cmd string
---@param payload table?
function Rollout:request(cmd, payload)
  return self.client:request(cmd, payload or {})
end

--- Pauses generation (payload {mode, kv}); returns the runtime's answer.
function Rollout:pause(payload)
  return self.client:request("pause", payload)
end

--- The TP workers' startup info, by TP rank (1-based).
function Rollout:workers()
  return self.info.workers
end

--- Initializes the workers' weights once per runtime: each worker maps its
--- rank's packed buffers (`descriptors[rank + 1]`, of `transport`), and its
--- gate (`gates[rank + 1]`, chunks ordered on the device), and sizes its
--- resident storage to its loader plan.
---@param plan wsync.Plan
---@param tp integer
---@param transport string
---@param descriptors string[][]
function Rollout:init_weights(plan, tp, transport, descriptors, gates)
  if self.initialized then
    return
  end
  local answer = self:request("init_weights", { family = plan.family, config = plan.config, tp = tp,
    transport = transport, buffers = descriptors, gates = gates, quantization = plan.quantization })
  -- (Whether its workers wait on the device for the ranks' gates: chunks
  -- ordered on the device.)
  self.ordered = gates ~= nil and answer.ordered == true
  self.initialized = true
  self.chunks_sent = {}
end

--- The runtime loads chunk `k` from buffer slot `buffer`. A chunk's tensor
--- metadata goes to a runtime once after its init_weights: its TP workers
--- plan the chunk's loads then and keep the plan by chunk number, so later
--- publications send no per-tensor JSON. A worker asked to load a chunk whose
--- metadata it never got fails the publication. `gate` ({seq, last}):
--- chunks ordered on the device, the load queued (answered once it finished
--- only when `last`). The plan's last chunk is marked (`last`): a runtime
--- may have its TP workers make their receipts with that load (the
--- reference runtime does; finish_update still checks and commits them).
---@param plan wsync.Plan
---@param k integer
---@param buffer integer
function Rollout:load_chunk(plan, k, buffer, tensors, gate)
  local payload = { chunk = k, buffer = buffer, gate = gate, last = k == #plan.chunks or nil }
  if not self.chunks_sent[k] then
    payload.tensors = tensors or plan.chunks[k].tensors
  end
  local answer = self:request("load_chunk", payload)
  self.chunks_sent[k] = true
  return answer
end

--- The resident tensor count of every TP rank (the header's
--- `resident_tensors`), from the plan: computed once per plan and TP size.
---@param plan wsync.Plan
---@param tp integer
---@return integer[]
function M.resident_counts(plan, tp)
  plan.resident_counts = plan.resident_counts or {}
  if not plan.resident_counts[tp] then
    local family = plan_module.family(plan.family)
    local counts = {}
    for rank = 0, tp - 1 do
      counts[rank + 1] = #family.loader_plan(plan.config, tp, rank, plan.quantization).tensors
    end
    plan.resident_counts[tp] = counts
  end
  return plan.resident_counts[tp]
end

--- Destroys the runtime's process tree after a failed publication (fail
--- stop: a partly loaded runtime is never used again) and waits until it is
--- gone.
---@param cause any
function Rollout:destroy(cause)
  self.poisoned = self.poisoned or cause
  if self.client.state ~= "CLOSED" then
    self.client:destroy("poisoned: " .. (errors.is(cause) and cause.message or tostring(cause)))
    self.client:wait_dead()
  end
  self.initialized = false
end

--- Ends the runtime: shut down politely when it is idle, destroyed when a
--- request is still in flight (a REPL chunk abandoned mid-publication: its
--- state is unknown). Waits until the tree is gone.
function Rollout:close()
  local client = self.client
  if client.state == "INFLIGHT" then
    client:destroy("the session closed with " .. tostring(client.inflight.pending and client.inflight.pending.cmd)
      .. " in flight")
  end
  if client.state ~= "CLOSED" then
    client:close()
  end
end

--- What `wsync repl --attach` shows of it.
function Rollout:state()
  return { state = self.client.state, pid = self.client.pid, workers = #self.info.workers }
end

--- The runtime clients (one; a replica set has one per replica).
---@return wsync.RuntimeClient[]
function Rollout:clients()
  return { self.client }
end

--- Validates the answer of `finish_update` to `header` (the host's check
--- after the runtime's own: wsync.runtime.contract.check_finish).
---@param header table
---@param result table
function Rollout:check_finish(header, result)
  require("wsync.runtime.contract").check_finish(header, result)
end

--- A resident-check answer as one list of worker results per replica.
---@param reported table
---@return table[][]
function Rollout:by_replica(reported)
  return { reported.workers }
end

-- Several replicas -----------------------------------------------------------

--- R rollout replicas of TP size T each, driven as one: trainer rank r feeds
--- TP worker r % T of replica r // T, on the same device. Each replica is its
--- own runtime (process group, client, state, receipts); a command goes to
--- every replica at once, each with its part of the payload (its ranks'
--- buffers, its part of the header), and fails when one replica fails. The
--- session commits a version only once every replica finished it, and a
--- failure in any replica destroys them all (wsync.publish.publication).
---@class wsync.ReplicaSet
---@field replicas wsync.Rollout[]
---@field tp integer
---@field info table   the first replica's info
---@field poisoned wsync.Error?
local ReplicaSet = {}
ReplicaSet.__index = ReplicaSet
M.ReplicaSet = ReplicaSet

--- Spawns `count` replicas of `options.tp` workers each, at once: replica i
--- on `options.devices[i*tp + 1 .. (i+1)*tp]`. The fault of replica i, for
--- tests, is $WSYNC_RUNTIME_FAULT_<i> when set. Raises RUNTIME_START naming
--- the replica that did not start (the others are destroyed first).
---@param options table
---@param count integer
---@return wsync.ReplicaSet
function M.spawn_replicas(options, count)
  local tp = options.tp or 1
  local results, failed, err = require("wsync.loop").all(count, function(index)
    local devices = {}
    for rank = 1, tp do
      devices[rank] = options.devices and options.devices[(index - 1) * tp + rank] or ((index - 1) * tp + rank - 1)
    end
    return M.spawn(util.merged(options, {
      devices = devices, fault = os.getenv("WSYNC_RUNTIME_FAULT_" .. (index - 1)) or options.fault,
      output = options.output and string.format("[runtime %d] ", index - 1),
    }))
  end)
  if failed then
    for index = 1, count do
      if results[index] then
        results[index]:destroy("another replica did not start")
      end
    end
    errors.raise("RUNTIME_START", string.format("replica %d: %s", failed - 1,
      errors.is(err) and err.message or tostring(err)), { replica = failed - 1 })
  end
  return setmetatable({ replicas = results, tp = tp, info = results[1].info, initialized = false }, ReplicaSet)
end

-- Runs `task(replica, index)` on every replica at once; returns the results,
-- or raises the first failure naming its replica (the error keeps its code
-- and fields, the message says which replica).
local function each(self, task)
  local results, failed, err = require("wsync.loop").all(#self.replicas, function(index)
    return task(self.replicas[index], index)
  end)
  if failed then
    if errors.is(err) then
      err.message = string.format("replica %d: %s", failed - 1, err.message)
      err.replica = failed - 1
      error(err, 0)
    end
    errors.raise("RUNTIME_FAILED", string.format("replica %d: %s", failed - 1, tostring(err)),
      { replica = failed - 1 })
  end
  return results
end

-- The part of `header` that replica `index` (1-based) gets: its devices.
local function header_of(header, tp, index)
  local uuids = {}
  for rank = 1, tp do
    uuids[rank] = header.uuids[(index - 1) * tp + rank]
  end
  return util.merged(header, { uuids = uuids })
end

--- Every replica's TP workers, in trainer rank order.
function ReplicaSet:workers()
  local all = {}
  for _, replica in ipairs(self.replicas) do
    for _, worker in ipairs(replica:workers()) do
      all[#all + 1] = worker
    end
  end
  return all
end

-- Generation is balanced over the replicas: each request goes to one of
-- them, in turn. A request's id across the set is (local id - 1) x R +
-- replica, so that it names its replica (1-based ids both ways).
local function global_id(self, index, id)
  return (id - 1) * #self.replicas + index
end

local function local_id(self, id)
  local replicas = #self.replicas
  return math.floor((id - 1) / replicas) + 1, (id - 1) % replicas + 1
end

-- Splits `items` over the replicas in turn from self.next_replica; returns
-- the lists by replica and, by item, {replica, position in its list}.
local function balance(self, items)
  local lists, where = {}, {}
  for index = 1, #self.replicas do
    lists[index] = {}
  end
  for position, item in ipairs(items or {}) do
    local index = (self.next_replica or 0) % #self.replicas + 1
    self.next_replica = index
    local list = lists[index]
    list[#list + 1] = item
    where[position] = { index, #list }
  end
  return lists, where
end

--- Generates: every prompt on one replica (in turn); the outputs in the
--- prompts' order.
function ReplicaSet:_generate(payload)
  local lists, where = balance(self, payload.prompts)
  local results = each(self, function(replica, index)
    return replica:request("generate", { prompts = lists[index], sampling = payload.sampling })
  end)
  local outputs = {}
  for position, at in ipairs(where) do
    outputs[position] = results[at[1]].outputs[at[2]]
  end
  return { model_version = results[1].model_version, outputs = outputs, replicas = results }
end

--- Streams: every request on one replica (in turn); ids across the set.
function ReplicaSet:_submit(payload)
  local lists, where = balance(self, payload.requests)
  local results = each(self, function(replica, index)
    if #lists[index] == 0 then
      return { ids = {} }
    end
    return replica:request("submit", { requests = lists[index] })
  end)
  local ids = {}
  for position, at in ipairs(where) do
    ids[position] = global_id(self, at[1], results[at[1]].ids[at[2]])
  end
  return { ids = ids }
end

--- What the requests (all, or those of `ids`, across the set) produced since
--- the last poll, ordered by id.
function ReplicaSet:_poll(payload)
  local wanted = nil
  if payload.ids and #payload.ids > 0 then
    wanted = {}
    for index = 1, #self.replicas do
      wanted[index] = {}
    end
    for _, id in ipairs(payload.ids) do
      local own, index = local_id(self, id)
      local list = wanted[index]
      list[#list + 1] = own
    end
  end
  local results = each(self, function(replica, index)
    if wanted and #wanted[index] == 0 then
      return { requests = {}, in_flight = 0 }
    end
    return replica:request("poll", { ids = wanted and wanted[index] or nil })
  end)
  local requests, in_flight = {}, 0
  for index, result in ipairs(results) do
    in_flight = in_flight + (result.in_flight or 0)
    for _, request in ipairs(result.requests) do
      request.id, request.replica = global_id(self, index, request.id), index - 1
      requests[#requests + 1] = request
    end
  end
  table.sort(requests, function(a, b)
    return a.id < b.id
  end)
  return { requests = requests, in_flight = in_flight }
end

--- Sends `cmd` to every replica; `start_update` gets each replica its part
--- of the header, and generation is balanced over them (each request on one
--- replica). Returns the first replica's result, with `replicas` (every
--- replica's, in order) and, for answers with `workers`, all of them.
function ReplicaSet:request(cmd, payload)
  payload = payload or {}
  if cmd == "generate" then
    return self:_generate(payload)
  elseif cmd == "submit" then
    return self:_submit(payload)
  elseif cmd == "poll" then
    return self:_poll(payload)
  end
  local results = each(self, function(replica, index)
    local own = payload
    if cmd == "start_update" and payload and payload.header then
      own = { header = header_of(payload.header, self.tp, index) }
    end
    return replica:request(cmd, own)
  end)
  local merged = util.merged(results[1], { replicas = results })
  if cmd == "finish_update" then
    -- (Released in its finish answer only when every replica released.)
    for _, result in ipairs(results) do
      merged.released = merged.released and result.released == true or nil
    end
  end
  -- Lists every replica answers with, joined in replica order.
  for _, field in ipairs({ "workers", "receipts" }) do
    if type(results[1][field]) == "table" then
      merged[field] = {}
      for _, result in ipairs(results) do
        for _, item in ipairs(result[field] or {}) do
          merged[field][#merged[field] + 1] = item
        end
      end
    end
  end
  return merged
end

--- Pauses generation on every replica, in two phases. Phase 1: each replica
--- pauses on its own, all at once (it finishes the step it is in, answering
--- its commands meanwhile). Phase 2: only once every replica said it paused
--- does this return, and only then may weights move. A replica that fails
--- to pause, or does not within the pause timeout, fails the round before
--- any weight moved: it is destroyed as broken, every replica that did pause
--- resumes, and the error (PAUSE_FAILED) names the replica.
function ReplicaSet:pause(payload)
  local outcomes = require("wsync.loop").all(#self.replicas, function(index)
    return { pcall(self.replicas[index].pause, self.replicas[index], payload) }
  end)
  local failed = nil
  for index, outcome in ipairs(outcomes) do
    if not outcome[1] and not failed then
      failed = { index = index, cause = outcome[2] }
    end
  end
  if not failed then
    local merged = { replicas = {} }
    for index, outcome in ipairs(outcomes) do
      merged.replicas[index] = outcome[2]
    end
    return merged
  end
  local cause = errors.is(failed.cause) and failed.cause.message or tostring(failed.cause)
  for index, outcome in ipairs(outcomes) do
    if outcome[1] then
      pcall(self.replicas[index].request, self.replicas[index], "resume", {})
    else
      self.replicas[index]:destroy(outcome[2])
    end
  end
  errors.raise("PAUSE_FAILED", string.format("replica %d did not pause: %s; the other replicas resumed, no weight "
    .. "moved", failed.index - 1, cause), { replica = failed.index - 1 })
end

--- Initializes every replica's weights with its ranks' buffers.
function ReplicaSet:init_weights(plan, tp, transport, descriptors, gates)
  each(self, function(replica, index)
    local own, own_gates = {}, gates and {} or nil
    for rank = 1, tp do
      own[rank] = descriptors[(index - 1) * tp + rank]
      if gates then
        own_gates[rank] = gates[(index - 1) * tp + rank]
      end
    end
    replica:init_weights(plan, tp, transport, own, own_gates)
  end)
  self.ordered = gates ~= nil
  for _, replica in ipairs(self.replicas) do
    self.ordered = self.ordered and replica.ordered
  end
  self.initialized = true
end

--- Every replica loads chunk `k`; the bytes of all, the slowest copy.
function ReplicaSet:load_chunk(plan, k, buffer, tensors, gate)
  local answers = each(self, function(replica)
    return replica:load_chunk(plan, k, buffer, tensors, gate)
  end)
  local bytes, copy_seconds = 0, 0
  for _, answer in ipairs(answers) do
    bytes = bytes + (answer.bytes or 0)
    copy_seconds = math.max(copy_seconds, tonumber(answer.copy_seconds) or 0)
  end
  return { chunk = k, bytes = bytes, copy_seconds = copy_seconds }
end

--- Validates every replica's answer to `finish_update` with its part of the
--- header.
function ReplicaSet:check_finish(header, result)
  for index, replica in ipairs(self.replicas) do
    local ok, err = pcall(replica.check_finish, replica, header_of(header, self.tp, index), result.replicas[index])
    if not ok then
      if errors.is(err) then
        err.message = string.format("replica %d: %s", index - 1, err.message)
      end
      error(err, 0)
    end
  end
end

--- A resident-check answer as one list of worker results per replica.
function ReplicaSet:by_replica(reported)
  return util.field_values(reported.replicas, "workers")
end

--- Destroys every replica (a failure in one poisons the publication on all).
function ReplicaSet:destroy(cause)
  self.poisoned = self.poisoned or cause
  for _, replica in ipairs(self.replicas) do
    replica:destroy(cause)
  end
  self.initialized = false
end

--- Ends every replica.
function ReplicaSet:close()
  for _, replica in ipairs(self.replicas) do
    replica:close()
  end
end

function ReplicaSet:state()
  local states = {}
  for index, replica in ipairs(self.replicas) do
    states[index] = replica:state()
  end
  return { replicas = states, state = states[1].state, pid = states[1].pid, workers = #self:workers() }
end

function ReplicaSet:clients()
  return util.field_values(self.replicas, "client")
end

-- The recipe's runtime ----------------------------------------------------------

--- Spawns the runtime `recipe` asks for (its runtime, backend, memory and
--- timeouts) on `devices`, the trainer ranks' device indices in rank order:
--- one of `topology.tp` workers, or with `topology.replicas` several, replica
--- i on the devices of trainer ranks i*TP .. i*TP + TP - 1. Its output is
--- relayed as "[runtime] " ("[runtime I] "); a command that waits for its
--- answer, the startup handshake included, is named while the host waits,
--- with `where()` (the session's phase). Raises RUNTIME_START.
---@param recipe table
---@param topology {tp: integer, replicas: integer?}
---@param devices integer[]
---@param where fun(): string
---@return wsync.Rollout|wsync.ReplicaSet
function M.start(recipe, topology, devices, where)
  local options = {
    kind = recipe.runtime.kind, tp = topology.tp, backend = recipe.backend, devices = devices,
    kv_bytes = math.max(recipe.memory.kv_bytes, 1), timeouts = recipe.timeouts, grace_ms = recipe.runtime.grace_ms,
    model = recipe.runtime.kind == "vllm" and require("wsync.runtime.vllm").model_dir(recipe) or nil,
    load = recipe.runtime.load, check = recipe.runtime.check, channel = recipe.runtime.channel,
    engine = recipe.runtime.vllm,
    python = recipe.runtime.python,
    output = "[runtime] ",
    on_slow = function(client, cmd, waited, deadline)
      console.say("waiting for the %s (pid %d) to answer %s%s: %.0f s so far, deadline %g s (%s)", client.name,
        client.pid, cmd, client.startup_info == nil and " (its startup handshake)" or "", waited, deadline, where())
    end,
  }
  local replicas = topology.replicas or 1
  if replicas > 1 then
    return M.spawn_replicas(options, replicas)
  end
  return M.spawn(options)
end

return M
