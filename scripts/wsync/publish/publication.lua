--- One publication, host side (shared/DESIGN.md section 5): preflight, header,
--- init once per runtime, start, chunks (fill by every agent, consensus, load
--- by the runtime, double-buffered), verify, finish with receipts, commit.
---
--- Fail-stop: any failure after start poisons. The runtime's process tree is
--- destroyed, no version is committed, and the caller answers every agent's
--- `publish` with the same error object {code = "PUBLISH_FAILED", phase, rank,
--- message}. No retry, no fallback. A failure before start (preflight) moves
--- nothing and leaves the runtime as it was.
---
--- Buffer policy: each rank's packed buffers are created at the first
--- publication of a session and kept (mapped by every rank and by the runtime)
--- until the session closes; each publication refills them. The runtime maps
--- them once per runtime process (init_weights).
local uv = require("luv")
local errors = require("wsync.errors")
local loop = require("wsync.loop")
local plan_module = require("wsync.plan")
local protocol = require("wsync.control.protocol")
local receipts_module = require("wsync.publish.receipts")

local M = {}

local function now()
  return uv.hrtime() / 1e9
end

local function fail(code, message, fields)
  errors.raise(code, message, fields)
end

--- Sends `cmd` to every agent at once; returns results by rank (1-based).
--- Raises the failure of the lowest failing rank, with its rank.
---@param session table
---@param cmd string
---@param payload_of fun(rank: integer): table
---@param timeout number
function M.all_agents(session, cmd, payload_of, timeout)
  local results, failed, err = loop.all(#session.agents, function(index)
    return session.agents[index].peer:request(cmd, payload_of(index - 1), timeout)
  end)
  if failed then
    local message = errors.is(err) and err.message or tostring(err)
    fail(errors.is(err) and err.code or "AGENT_FAILED", string.format("trainer rank %d: %s", failed - 1, message),
      { rank = failed - 1, phase = cmd })
  end
  return results
end

-- Preflight --------------------------------------------------------------------

--- Checks, before anything moves, everything DESIGN.md section 5.1 lists.
--- Raises PREFLIGHT naming the rank, tensor or byte count.
function M.preflight(session)
  local plan, agents = session.plan, session.agents
  local tp = session.topology.tp
  local function refuse(message, fields)
    fail("PREFLIGHT", message, fields)
  end
  if #agents ~= tp then
    refuse(string.format("trainer world %d does not equal the TP size %d", #agents, tp))
  end
  local hostname = uv.os_gethostname()
  local seen_uuid = {}
  local workers = session.runtime_info.workers
  -- Free memory as it is now, after the schedule's steps, while the buffers
  -- do not exist yet (once they do, they are part of what is in use).
  local memory = {}
  if not session.runtime_initialized then
    memory = M.all_agents(session, "memory", function()
      return {}
    end, session.timeouts.start)
  end
  for index, agent in ipairs(agents) do
    local rank = index - 1
    local info = agent.info
    if info.hostname ~= hostname then
      refuse(string.format("trainer rank %d runs on %s, the host on %s: one node only", rank,
        tostring(info.hostname), hostname), { rank = rank })
    end
    local uuid = info.device.uuid
    if seen_uuid[uuid] then
      refuse(string.format("trainer ranks %d and %d share device %s: one device per rank", seen_uuid[uuid], rank,
        uuid), { rank = rank })
    end
    seen_uuid[uuid] = rank
    local worker = workers[index]
    if not worker or worker.device.uuid ~= uuid then
      refuse(string.format("trainer rank %d is on device %s but TP worker %d is on %s", rank, uuid, rank,
        worker and worker.device.uuid or "nothing"), { rank = rank })
    end
    local needed = plan.buffer_bytes * plan.buffer_count + plan.largest.bytes + (session.headroom_bytes or 0)
    local free = memory[index] and memory[index].free_bytes
    if memory[index] and type(free) ~= "number" then
      refuse(string.format("trainer rank %d's device reports no free memory: the preflight cannot check it", rank),
        { rank = rank })
    end
    if free and free < needed then
      refuse(string.format("trainer rank %d's device has %d bytes free; the buffers need %d (%d x %d + largest "
        .. "tensor %d + headroom %d)", rank, free, needed, plan.buffer_count, plan.buffer_bytes,
        plan.largest.bytes, session.headroom_bytes or 0), { rank = rank })
    end
  end
  M.check_registration(session)
end

--- Checks that what every rank registered is the plan's trainer layout: every
--- tensor present with the plan's dtype and global shape, and the ranks' dim-0
--- rows covering it exactly once. Names the rank and the tensor.
function M.check_registration(session)
  local plan = session.plan
  local expected = {}
  for _, tensor in ipairs(plan.layout) do
    expected[tensor.name] = tensor
  end
  local covered = {}
  for index, agent in ipairs(session.agents) do
    local rank = index - 1
    local registered = {}
    for _, tensor in ipairs(agent.info.tensors) do
      local want = expected[tensor.name]
      if not want then
        fail("PREFLIGHT", string.format("trainer rank %d registered %s, which the %s plan does not export", rank,
          tensor.name, plan.family), { rank = rank, tensor = tensor.name })
      end
      local same = tensor.dtype == want.dtype and #tensor.shape == #want.shape
      for d = 1, #want.shape do
        same = same and tensor.shape[d] == want.shape[d]
      end
      if not same then
        fail("PREFLIGHT", string.format("trainer rank %d registered %s as %s %s; the model config says %s %s", rank,
          tensor.name, tostring(tensor.dtype), table.concat(tensor.shape, "x"), want.dtype,
          table.concat(want.shape, "x")), { rank = rank, tensor = tensor.name })
      end
      registered[tensor.name] = true
      local rows = covered[tensor.name] or {}
      covered[tensor.name] = rows
      rows[#rows + 1] = { first = tensor.rows[1], count = tensor.rows[2], rank = rank }
    end
    for _, tensor in ipairs(plan.layout) do
      if not registered[tensor.name] then
        fail("PREFLIGHT", string.format("trainer rank %d did not register %s", rank, tensor.name),
          { rank = rank, tensor = tensor.name })
      end
    end
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
          fail("PREFLIGHT", string.format("%s: rank %d's rows start at %d, expected %d (shards must cover dim 0 "
            .. "exactly once)", tensor.name, range.rank, range.first, next_row), { rank = range.rank,
            tensor = tensor.name })
        end
        next_row = range.first + range.count
      end
    end
    if next_row ~= tensor.shape[1] then
      fail("PREFLIGHT", string.format("%s: the ranks' shards cover %d of %d rows", tensor.name, next_row,
        tensor.shape[1]), { tensor = tensor.name })
    end
  end
end

-- Init ---------------------------------------------------------------------------

--- Creates and exports the agents' packed buffers (once per session), has
--- every agent map every rank's buffers, and has the runtime map each TP
--- worker's rank buffers and size its resident storage (once per runtime).
function M.init(session)
  local plan = session.plan
  local timeout = session.timeouts.init
  if not session.buffer_names then
    local results = M.all_agents(session, "init_buffers", function()
      return { count = plan.buffer_count, bytes = plan.buffer_bytes }
    end, timeout)
    local names = {}
    for index, result in ipairs(results) do
      names[index] = result.names
    end
    M.all_agents(session, "attach", function()
      return { buffers = names }
    end, timeout)
    session.buffer_names = names
  end
  if not session.runtime_initialized then
    session.runtime:request("init_weights", {
      family = plan.family, config = plan.config, tp = session.topology.tp, transport = "shm",
      buffers = session.buffer_names,
    })
    session.runtime_initialized = true
    session.chunk_metadata_sent = {}
  end
end

--- The buffer slot that chunk `k` travels in (chunks take the buffers in turn).
function M.buffer_of(session, k)
  return (k - 1) % session.plan.buffer_count + 1
end

--- Every agent fills chunk `k` into its buffer slot; returns their reports
--- once all succeeded (the consensus gate).
function M.fill_chunk(session, k)
  local slots = M.fill_slots(session.plan.chunks[k])
  local buffer = M.buffer_of(session, k)
  return M.all_agents(session, "fill", function()
    return { chunk = k, buffer = buffer, slots = slots }
  end, session.timeouts.fill)
end

--- The runtime loads chunk `k` from its buffer slot. A chunk's tensor
--- metadata goes to a runtime once after its init_weights: its TP workers keep
--- it by chunk number and check it on every load as when it came, so later
--- publications send no per-tensor JSON. A worker asked to load a chunk whose
--- metadata it never got fails the publication.
function M.load_chunk(session, k)
  session.chunk_metadata_sent = session.chunk_metadata_sent or {}
  local payload = { chunk = k, buffer = M.buffer_of(session, k) }
  if not session.chunk_metadata_sent[k] then
    payload.tensors = session.plan.chunks[k].tensors
  end
  local answer = session.runtime:request("load_chunk", payload)
  session.chunk_metadata_sent[k] = true
  return answer
end

-- Chunks ---------------------------------------------------------------------------

-- A tiny condition: `wait(predicate)` suspends until `predicate()` holds,
-- re-checked on every `notify()`.
local function condition()
  local waiters = {}
  local self = {}
  function self.wait(predicate)
    while not predicate() do
      loop.await(function(resume)
        waiters[#waiters + 1] = resume
      end)
    end
  end
  function self.notify()
    local current = waiters
    waiters = {}
    for _, resume in ipairs(current) do
      resume()
    end
  end
  return self
end

--- What the agents get to fill a chunk: its slots' names and offsets.
function M.fill_slots(chunk)
  if not chunk.fill_payload then
    local slots = {}
    for i, slot in ipairs(chunk.slots) do
      slots[i] = { name = slot.name, offset = slot.offset }
    end
    chunk.fill_payload = slots
  end
  return chunk.fill_payload
end

--- Moves chunks `first`..last: agents fill chunk k into buffer k mod B; when
--- every rank reported success (the consensus gate) the runtime loads it;
--- only after the load may that buffer be refilled. With two buffers, chunk
--- k+1 fills while chunk k loads. Returns {fill = seconds, load = seconds}.
function M.move_chunks(session, first)
  local plan = session.plan
  local count, buffers = #plan.chunks, plan.buffer_count
  local filled, loaded = first - 1, first - 1
  local failure = nil
  local fill_seconds, load_seconds = 0, 0
  local changed = condition()

  local function guarded(work)
    return function()
      local ok, err = pcall(work)
      if not ok and failure == nil then
        failure = err
      end
      changed.notify()
    end
  end
  local filler = guarded(function()
    for k = first, count do
      changed.wait(function()
        return failure ~= nil or loaded >= k - buffers
      end)
      if failure then
        return
      end
      local started = now()
      M.fill_chunk(session, k)
      fill_seconds = fill_seconds + (now() - started)
      filled = k -- every rank succeeded: chunk k may load
      changed.notify()
    end
  end)
  local loader = guarded(function()
    for k = first, count do
      changed.wait(function()
        return failure ~= nil or filled >= k
      end)
      if failure then
        return
      end
      local started = now()
      M.load_chunk(session, k)
      load_seconds = load_seconds + (now() - started)
      loaded = k
      changed.notify()
    end
  end)
  local roles = { filler, loader }
  loop.all(#roles, function(i)
    roles[i]()
  end)
  if failure then
    error(failure, 0)
  end
  return { fill = fill_seconds, load = load_seconds }
end

-- The whole publication ------------------------------------------------------------------

local function random_id()
  local bytes = uv.random(16)
  return (bytes:gsub(".", function(c)
    return string.format("%02x", c:byte())
  end))
end

---@class wsync.Publication
---@field session table
---@field header table        the publication header (DESIGN.md 5.2)
---@field phase string        the phase running or last done
---@field timings table<string, number>
---@field next_chunk integer  the chunk that `chunk()` moves next
---@field fills table[]       per chunk, the agents' consensus reports
---@field loads table[]       per chunk, the runtime's load answer
---@field result table?       the runtime's finish answer (receipts)
local Publication = {}
Publication.__index = Publication

--- Starts a publication of trainer step `step`: nothing moves until its
--- phases run (`run()` runs them all; the REPL steps through them).
---@param session table
---@param step integer
---@return wsync.Publication
function M.new(session, step)
  return setmetatable({
    session = session, step = step, phase = "new", timings = {}, next_chunk = 1, fills = {}, loads = {},
    started = now(), completed = {},
  }, Publication)
end

-- The phase each phase needs completed before it: the REPL may call them in
-- any order, and a step out of order is refused before it does anything.
local NEEDS = { init = "preflight", start = "init", chunks = "start", verify = "chunks", finish = "verify",
  release = "finish" }

-- Refuses phase `name` when its predecessor has not completed or it has
-- (chunks: while chunks remain). Nothing has moved: no poison.
function Publication:_check_order(name)
  local needed = NEEDS[name]
  local done = self.completed
  if needed == "chunks" and self.next_chunk <= #self.session.plan.chunks then
    errors.raise("PHASE_ORDER", string.format("%s needs every chunk moved first (%d of %d moved)", name,
      self.next_chunk - 1, #self.session.plan.chunks), { phase = name })
  elseif needed and needed ~= "chunks" and not done[needed] then
    errors.raise("PHASE_ORDER", string.format("%s needs %s first", name, needed), { phase = name })
  elseif name ~= "chunks" and done[name] then
    errors.raise("PHASE_ORDER", string.format("%s has already run for this publication", name), { phase = name })
  end
end

-- Runs fn as phase `name`, timed. After start, any failure poisons.
function Publication:_phase(name, fn)
  if self.failed then
    error(self.failed, 0)
  end
  self:_check_order(name)
  self.phase = name
  local started = now()
  local ok, result = pcall(fn)
  self.timings[name] = (self.timings[name] or 0) + (now() - started)
  if not ok then
    self:_fail(result)
  end
  self.completed[name] = true
  return result
end

function Publication:_fail(err)
  if not self.started_update then
    if errors.is(err) and err.phase == nil then
      err.phase = self.phase -- "preflight": the error says where it stopped
    end
    self.failed = err
    error(err, 0) -- before start nothing moved: no poison
  end
  M.poison(self.session, err)
  local fields = { phase = self.phase, rank = errors.is(err) and err.rank or nil,
    cause = errors.is(err) and err.code or "LUA_ERROR" }
  local message = string.format("publication of model version %d failed in %s: %s", self.header.model_version,
    self.phase, errors.is(err) and err.message or tostring(err))
  self.failed = errors.new("PUBLISH_FAILED", message, fields)
  error(self.failed, 0)
end

--- Preflight (nothing moves) and the header.
function Publication:preflight()
  local session = self.session
  self:_phase("preflight", function()
    M.preflight(session)
  end)
  local plan = session.plan
  local uuids, resident = {}, {}
  for index, agent in ipairs(session.agents) do
    uuids[index] = agent.info.device.uuid
  end
  local family = plan_module.family(plan.family)
  for rank = 0, session.topology.tp - 1 do
    resident[rank + 1] = #family.loader_plan(plan.config, session.topology.tp, rank).tensors
  end
  self.header = {
    protocol = protocol.VERSION, transport = "shm", publication_id = random_id(),
    model_version = M.next_version(session), tp_world = session.topology.tp, manifest = plan.manifest,
    uuids = uuids, resident_tensors = resident, step = self.step,
  }
  return self.header
end

--- Buffers created, exported and mapped (once per session and runtime).
function Publication:init()
  self:_phase("init", function()
    M.init(self.session)
  end)
end

--- The runtime enters update mode; the agents start their consumed manifests.
function Publication:start()
  local session, header = self.session, self.header
  self:_phase("start", function()
    self.started_update = true -- from here on, a failure poisons
    session.runtime:request("start_update", { header = header })
    M.all_agents(session, "begin", function()
      return { family = session.plan.family, publication_id = header.publication_id }
    end, session.timeouts.start)
  end)
end

--- Moves the next chunk alone (fill by every rank, consensus, load): the
--- REPL's single step. Returns the chunk's number and reports.
function Publication:chunk()
  local session, k = self.session, self.next_chunk
  if not session.plan.chunks[k] then
    error(string.format("all %d chunks have moved", #session.plan.chunks), 2)
  end
  self:_phase("chunks", function()
    local started = now()
    self.fills[k] = M.fill_chunk(session, k)
    self.timings.fill = (self.timings.fill or 0) + (now() - started)
    started = now()
    self.loads[k] = M.load_chunk(session, k)
    self.timings.load = (self.timings.load or 0) + (now() - started)
  end)
  self.next_chunk = k + 1
  return { chunk = k, fills = self.fills[k], load = self.loads[k] }
end

--- Moves every remaining chunk, double-buffered.
function Publication:chunks()
  local moved = self:_phase("chunks", function()
    return M.move_chunks(self.session, self.next_chunk)
  end)
  self.timings.fill = (self.timings.fill or 0) + moved.fill
  self.timings.load = (self.timings.load or 0) + moved.load
  self.next_chunk = #self.session.plan.chunks + 1
end

--- Every agent's consumed manifest must equal the expected one.
function Publication:verify()
  local plan = self.session.plan
  self.consumed = self:_phase("verify", function()
    local results = M.all_agents(self.session, "verify", function()
      return {}
    end, self.session.timeouts.verify)
    for index, result in ipairs(results) do
      if result.manifest ~= plan.manifest then
        fail("VERIFY_FAILED", string.format("trainer rank %d exported manifest %s (%d tensors); expected %s (%d)",
          index - 1, result.manifest, result.tensors, plan.manifest, #plan.canonical), { rank = index - 1 })
      end
    end
    return results
  end)
  return self.consumed
end

--- The runtime validates the workers' receipts and commits; the host
--- validates them again.
function Publication:finish()
  local header = self.header
  self.result = self:_phase("finish", function()
    if self.next_chunk <= #self.session.plan.chunks then
      fail("NOT_ALL_CHUNKS", string.format("finish with chunk %d of %d not moved", self.next_chunk,
        #self.session.plan.chunks))
    end
    local result = self.session.runtime:request("finish_update", {
      publication_id = header.publication_id, model_version = header.model_version,
    })
    if result.model_version ~= header.model_version then
      fail("RECEIPT_INVALID", string.format("the runtime committed version %s, not %d", tostring(result.model_version),
        header.model_version))
    end
    if result.prefix_cache_reset ~= true then
      fail("RECEIPT_INVALID", "the runtime committed without resetting its prefix cache (cached prefixes of the old "
        .. "weights would be served)")
    end
    receipts_module.check(header, result.receipts, header.resident_tensors)
    return result
  end)
  return self.result.receipts
end

--- Release per the buffer policy ("keep": buffers stay allocated and mapped
--- for the next publication; the runtime confirms it reads none of them),
--- then the host counts the version as committed.
function Publication:release()
  self:_phase("release", function()
    self.session.runtime:request("release", { publication_id = self.header.publication_id })
  end)
  self.session.version = self.header.model_version
  self.phase = "done"
  return self:report()
end

--- The publication's report (after release).
function Publication:report()
  local plan = self.session.plan
  self.timings.total = now() - self.started
  return {
    model_version = self.header.model_version,
    publication_id = self.header.publication_id,
    step = self.step,
    manifest = plan.manifest,
    bytes = plan.bytes,
    chunks = #plan.chunks,
    timings = self.timings,
    gbps = plan.bytes / self.timings.total / 1e9,
    receipts = self.result.receipts,
  }
end

--- Runs every phase. Returns the report; raises PREFLIGHT (nothing moved) or
--- PUBLISH_FAILED (poisoned: the runtime's tree is destroyed, nothing
--- committed).
function Publication:run()
  self:preflight()
  self:init()
  self:start()
  self:chunks()
  self:verify()
  self:finish()
  return self:release()
end

--- Runs one publication of trainer step `step` (see Publication:run).
---@param session table
---@param step integer
function M.run(session, step)
  return M.new(session, step):run()
end

--- The model version for a new header: above every version committed or
--- given to a header before, so that a publication that failed after its
--- runtime committed (or one abandoned in the REPL) never shares its number.
---@param session table
---@return integer
function M.next_version(session)
  session.issued_version = math.max(session.issued_version or 0, session.version) + 1
  return session.issued_version
end

--- Destroys the runtime's process tree after a failed publication; the
--- session needs a new runtime before it can publish again.
function M.poison(session, cause)
  session.poisoned = cause
  if session.runtime and session.runtime.state ~= "CLOSED" then
    session.runtime:destroy("poisoned: " .. (errors.is(cause) and cause.message or tostring(cause)))
    session.runtime:wait_dead()
  end
  session.runtime_initialized = false
end

return M
