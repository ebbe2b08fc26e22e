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
---
--- A publication is given what it works with (wsync.publish.ranks, a
--- wsync.publish.rollout, the session's wsync.publish.versions), not the
--- session: it owns only its own phases, header, reports and timings.
local uv = require("luv")
local errors = require("wsync.errors")
local loop = require("wsync.loop")
local protocol = require("wsync.control.protocol")
local rollout_module = require("wsync.publish.rollout")

local M = {}

local function now()
  return uv.hrtime() / 1e9
end

local function fail(code, message, fields)
  errors.raise(code, message, fields)
end

-- Preflight --------------------------------------------------------------------

--- Checks, before anything moves, everything DESIGN.md section 5.1 lists.
--- Raises PREFLIGHT naming the rank, tensor or byte count. `context` is a
--- publication's (M.new).
function M.preflight(context)
  local plan, ranks, tp = context.plan, context.ranks, context.topology.tp
  local agents = ranks.agents
  local function refuse(message, fields)
    fail("PREFLIGHT", message, fields)
  end
  local replicas = context.topology.replicas or 1
  if #agents ~= tp * replicas then
    refuse(replicas == 1 and string.format("trainer world %d does not equal the TP size %d", #agents, tp)
      or string.format("trainer world %d does not equal %d replicas x TP %d", #agents, replicas, tp))
  end
  local hostname = uv.os_gethostname()
  local seen_uuid = {}
  local workers = context.rollout:workers()
  -- Free memory as it is now, after the schedule's steps, while the buffers
  -- do not exist yet (once they do, they are part of what is in use).
  local memory = {}
  if not ranks.descriptors then
    memory = ranks:memory(context.timeouts.start)
  end
  local needed = plan.buffer_bytes * plan.buffer_count + plan.largest.bytes + (context.headroom_bytes or 0)
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
      local which = replicas == 1 and string.format("TP worker %d", rank)
        or string.format("TP worker %d of replica %d", rank % tp, math.floor(rank / tp))
      refuse(string.format("trainer rank %d is on device %s but %s is on %s", rank, uuid, which,
        worker and worker.device.uuid or "nothing"), { rank = rank })
    end
    local free = memory[index] and memory[index].free_bytes
    if memory[index] and type(free) ~= "number" then
      refuse(string.format("trainer rank %d's device reports no free memory: the preflight cannot check it", rank),
        { rank = rank })
    end
    if free and free < needed then
      refuse(string.format("trainer rank %d's device has %d bytes free; the buffers need %d (%d x %d + largest "
        .. "tensor %d + headroom %d)", rank, free, needed, plan.buffer_count, plan.buffer_bytes,
        plan.largest.bytes, context.headroom_bytes or 0), { rank = rank })
    end
  end
  ranks:check_registration(plan)
end

--- The buffer slot that chunk `k` travels in (chunks take the buffers in turn).
---@param plan wsync.Plan
---@param k integer
function M.buffer_of(plan, k)
  return (k - 1) % plan.buffer_count + 1
end

-- Chunks ---------------------------------------------------------------------------

-- The longest copy of a chunk's fill among the ranks (they fill at once).
local function fill_copy_seconds(reports)
  local longest = 0
  for _, report in ipairs(reports) do
    longest = math.max(longest, tonumber(report.copy_seconds) or 0)
  end
  return longest
end

---@class wsync.Publication
---@field header table        the publication header (DESIGN.md 5.2)
---@field phase string        the phase running or last done
---@field timings table<string, number>
---@field next_chunk integer  the chunk that `chunk()` moves next
---@field fills table[]       per chunk, the agents' consensus reports
---@field loads table[]       per chunk, the runtime's load answer
---@field result table?       the runtime's finish answer (receipts)
---@field trace table[]?      per chunk, its fill's and load's times (kept with the context's `trace`)
---@field serial boolean      chunks move one at a time (the context's `serial`)
local Publication = {}
Publication.__index = Publication

---@class wsync.PublicationContext
---@field plan wsync.Plan
---@field topology {world: integer, tp: integer}
---@field ranks wsync.Ranks
---@field rollout wsync.Rollout
---@field versions wsync.Versions
---@field timeouts table<string, number>
---@field transport string
---@field headroom_bytes integer?
---@field step integer
---@field trace boolean?  each report carries `trace`: per chunk, when its fill and its load were asked for and
---  answered (seconds since the publication started) and their copies' own seconds, {fill = {asked, answered,
---  copy}, load = ...}; for benchmarks (tests/bench/cuda_publish.lua). Off, nothing is kept.
---@field serial boolean?  chunks move one at a time, fill k and then load k, never at once: for benchmarks that
---  time each side alone (tests/bench/cuda_publish.lua `serial:`). Off, chunk k+1 fills while chunk k loads.

--- Starts a publication of trainer step `context.step`: nothing moves until
--- its phases run (`run()` runs them all; the REPL steps through them).
---@param context wsync.PublicationContext
---@return wsync.Publication
function M.new(context)
  return setmetatable({
    plan = context.plan, topology = context.topology, ranks = context.ranks, rollout = context.rollout,
    versions = context.versions, timeouts = context.timeouts, transport = context.transport,
    headroom_bytes = context.headroom_bytes, step = context.step,
    trace = context.trace and {} or nil, serial = context.serial == true,
    phase = "new", timings = { fill_copy = 0, load_copy = 0 }, next_chunk = 1, fills = {}, loads = {},
    started = now(), completed = {},
  }, Publication)
end

-- Chunk `k` once: every rank fills it (the consensus gate), then the runtime
-- loads it. Adds the phases' times and the copies' own times.
-- Notes chunk k's `side` ("fill" or "load") in the trace, when it keeps one.
function Publication:_note(k, side, started, copy)
  if self.trace then
    self.trace[k] = self.trace[k] or {}
    self.trace[k][side] = { started - self.started, now() - self.started, copy }
  end
end

-- (A fill or load that fails counts its time too: the report shows where the
-- seconds went.) With `verify`, every rank answers with its consumed
-- manifest too (`consumed`): for the last chunk, whose fill is not only
-- queued.
function Publication:_fill(k, gate, verify)
  local started = now()
  -- (The publication's first fill starts it on every rank: `begin`.)
  local begin = nil
  if not self.begun then
    self.begun = true
    begin = { family = self.plan.family, publication_id = self.header.publication_id }
  end
  local ok, reports = pcall(self.ranks.fill, self.ranks, self.plan, k, M.buffer_of(self.plan, k), self.timeouts.fill,
    { gate = gate, begin = begin, verify = verify or nil })
  self.timings.fill = (self.timings.fill or 0) + (now() - started)
  if not ok then
    error(reports, 0)
  end
  local copy = fill_copy_seconds(reports)
  self.timings.fill_copy = self.timings.fill_copy + copy
  self:_note(k, "fill", started, copy)
  self.fills[k] = reports
  return reports
end

function Publication:_load(k, gate)
  self:_started() -- (no chunk loads before the runtime is updating)
  local started = now()
  local tensors = self.plan.direct and self.ranks:direct_tensors(self.plan, k) or nil
  local ok, answer = pcall(self.rollout.load_chunk, self.rollout, self.plan, k, M.buffer_of(self.plan, k), tensors,
    gate)
  self.timings.load = (self.timings.load or 0) + (now() - started)
  if not ok then
    error(answer, 0)
  end
  self.timings.load_copy = self.timings.load_copy + (tonumber(answer.copy_seconds) or 0)
  self:_note(k, "load", started, tonumber(answer.copy_seconds) or 0)
  self.loads[k] = answer
  return answer
end

-- Runs `filler(state)` and `loader(state)` at once. `state.failure` holds the
-- first failure of either (after `on_fill_failure(err)` when the filler's)
-- and `state.changed` wakes the other; raises that failure once both ended.
local function fill_and_load(filler, loader, on_fill_failure)
  local state = { failure = nil, changed = loop.condition() }
  local roles = { filler, loader }
  loop.all(#roles, function(i)
    local ok, err = pcall(roles[i], state)
    if not ok and state.failure == nil then
      state.failure = err
      if i == 1 and on_fill_failure then
        on_fill_failure(err)
      end
    end
    state.changed:notify()
  end)
  if state.failure then
    error(state.failure, 0)
  end
end

--- Moves chunks `first`..last: the ranks fill chunk k into buffer k mod B;
--- when every rank reported success (the consensus gate) the runtime loads
--- it; only after the load may that buffer be refilled. With two buffers,
--- chunk k+1 fills while chunk k loads. With `verify` (run() does so), the
--- ranks answer the last chunk's fill with their consumed manifests, which
--- are checked then, while the runtime still loads (the verify phase; chunks
--- ordered on the device ask for them once the last load ran).
---
--- The direct path's fill moves nothing (the runtime reads the ranks' own
--- storage, which `begin` found where it was exported), so its loads wait
--- only for the first fill, which begins the publication on every rank; a
--- failed fill still poisons.
function Publication:_move_chunks(first, verify)
  local plan = self.plan
  if plan.gated and self.rollout.ordered and first == 1 and not self.serial then
    return self:_move_chunks_ordered(verify)
  end
  local count, buffers = #plan.chunks, plan.buffer_count
  if self.serial then
    for k = first, count do
      self:_fill(k, nil, verify and k == count)
      self:_load(k)
    end
    if verify then
      self:_verify_folded(self.fills[count])
    end
    return
  end
  local filled, loaded = first - 1, first - 1
  local waits_for_fill = not plan.direct
  fill_and_load(function(state)
    for k = first, count do
      state.changed:wait(function()
        return state.failure ~= nil or loaded >= k - buffers
      end)
      if state.failure then
        return
      end
      self:_fill(k, nil, verify and k == count)
      filled = k -- every rank succeeded: chunk k may load
      state.changed:notify()
    end
    if verify and state.failure == nil then
      self:_verify_folded(self.fills[count])
    end
  end, function(state)
    for k = first, count do
      state.changed:wait(function()
        return state.failure ~= nil or filled >= (waits_for_fill and k or first)
      end)
      if state.failure then
        return
      end
      self:_load(k)
      loaded = k
      state.changed:notify()
    end
  end)
end

--- Chunks ordered on the device (buffers.order = "device";
--- wsync.transport.cuda_ipc): the fills and loads are only queued, each
--- behind a device wait: fill k for load k - 1, load k for fill k (the
--- consensus gate, kept on the device: a load never reads a buffer before
--- its rank's fill of that chunk finished). The device then runs fill 1,
--- load 1, fill 2, ... back to back, with no host round trip between them
--- and never two processes' copies at once. The host still asks the runtime
--- to load chunk k only once every rank queued its fill, and the last load is
--- answered once everything finished; with `verify`, the ranks are asked
--- for their consumed manifests then (a rank's verify waits for its fills
--- on the device).
--- A failure poisons as ever: the destroyed runtime loads nothing more, and
--- each rank releases the fills it queued (its gate lives in its memory).
function Publication:_move_chunks_ordered(verify)
  local count = #self.plan.chunks
  local first = self.ranks:gate_numbers(count)
  local function number(k)
    return (first + k) % 2 ^ 32
  end
  local filled = 0
  fill_and_load(function(state)
    for k = 1, count do
      if state.failure then
        return
      end
      -- (Chunk 1 waits for nothing: the last publication's loads ended.)
      self:_fill(k, { after = k > 1 and number(k - 1) or nil, seq = number(k) })
      filled = k
      state.changed:notify()
    end
  end, function(state)
    for k = 1, count do
      state.changed:wait(function()
        return state.failure ~= nil or filled >= k
      end)
      if state.failure then
        return
      end
      self:_load(k, { seq = number(k), last = k == count })
    end
  end, function(err)
    -- (A load in flight may wait on the device for the fill that failed: the
    -- runtime goes now, not at its timeout.)
    self.rollout:destroy(err)
  end)
  if verify then
    self:_verify_folded()
  end
end

-- The whole publication ------------------------------------------------------------------

-- The phase each phase needs completed before it: the REPL may call them in
-- any order, and a step out of order is refused before it does anything.
local NEEDS = { init = "preflight", start = "init", chunks = "start", verify = "chunks", finish = "verify",
  release = "finish" }

-- Refuses phase `name` when its predecessor has not completed or it has
-- (chunks: while chunks remain). Nothing has moved: no poison.
function Publication:_check_order(name)
  local needed = NEEDS[name]
  local done = self.completed
  if needed == "chunks" and self.next_chunk <= #self.plan.chunks then
    errors.raise("PHASE_ORDER", string.format("%s needs every chunk moved first (%d of %d moved)", name,
      self.next_chunk - 1, #self.plan.chunks), { phase = name })
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
  self.rollout:destroy(err)
  -- (A phase folded into another one's time, verify into chunks', names
  -- itself: `folded_phase`.)
  local phase = errors.is(err) and err.folded_phase or self.phase
  local fields = { phase = phase, rank = errors.is(err) and err.rank or nil,
    cause = errors.is(err) and err.code or "LUA_ERROR" }
  local message = string.format("publication of model version %d failed in %s: %s", self.header.model_version,
    phase, errors.is(err) and err.message or tostring(err))
  self.failed = errors.new("PUBLISH_FAILED", message, fields)
  error(self.failed, 0)
end

--- Preflight (nothing moves) and the header.
function Publication:preflight()
  self:_phase("preflight", function()
    M.preflight(self)
  end)
  local _, uuids = self.ranks:devices()
  local tp = self.topology.tp
  self.header = {
    protocol = protocol.VERSION, transport = self.transport, publication_id = require("wsync.util").random_hex(16),
    model_version = self.versions:next(), tp_world = tp, manifest = self.plan.manifest,
    uuids = uuids, resident_tensors = rollout_module.resident_counts(self.plan, tp), step = self.step,
  }
  return self.header
end

--- Buffers created, exported and mapped (once per session and runtime).
--- Chunks ordered on the device need a runtime whose workers wait on the
--- ranks' gates (plan.gated): with buffers.order = "device" (plan.ordered)
--- one that cannot is refused here, before anything moved; with "auto" the
--- host orders them then.
function Publication:init()
  self:_phase("init", function()
    local descriptors, gates = self.ranks:init_buffers(self.plan, self.timeouts.init)
    self.rollout:init_weights(self.plan, self.topology.tp, self.transport, descriptors, gates)
    if self.plan.ordered and not self.rollout.ordered then
      fail("PREFLIGHT", "buffers.order = \"device\" needs a runtime whose TP workers wait on the device for the "
        .. "ranks' fills (on cuda: the reference runtime, the vllm runtime's direct loader); this one's do not: "
        .. "use buffers.order = \"host\"")
    end
  end)
end

--- The runtime enters update mode (its start_update; the ranks start the
--- publication with its first fill). With `overlapped` (run() does so) the
--- start_update is only sent: it is answered while chunk 1 fills, and no
--- chunk loads before it is (Publication:_started); a failure of it is still
--- named as start's.
---@param overlapped boolean?
function Publication:start(overlapped)
  self:_phase("start", function()
    self.started_update = true -- from here on, a failure poisons
    self:_start_update(overlapped)
  end)
end

-- Asks the runtime's start_update; with `overlapped`, in a coroutine of its
-- own whose answer (its seconds counted as start's) Publication:_started
-- waits for.
function Publication:_start_update(overlapped)
  local payload = { header = self.header }
  if not overlapped then
    self.rollout:request("start_update", payload)
    return
  end
  local starting = { changed = loop.condition() }
  self.starting = starting
  local started = now()
  loop.spawn(function()
    return self.rollout:request("start_update", payload)
  end, function(ok, err)
    self.timings.start = (self.timings.start or 0) + (now() - started)
    starting.done, starting.failure = true, not ok and err or nil
    starting.changed:notify()
  end)
end

-- Waits until the runtime answered start_update (overlapped: chunk 1 fills
-- meanwhile); raises its failure, named as start's.
function Publication:_started()
  local starting = self.starting
  if not starting then
    return
  end
  starting.changed:wait(function()
    return starting.done
  end)
  local failure = starting.failure
  if failure ~= nil then
    if errors.is(failure) then
      failure.folded_phase = "start"
    end
    error(failure, 0)
  end
end

--- Moves the next chunk alone (fill by every rank, consensus, load): the
--- REPL's single step. Returns the chunk's number and reports.
function Publication:chunk()
  local k = self.next_chunk
  if not self.plan.chunks[k] then
    error(string.format("all %d chunks have moved", #self.plan.chunks), 2)
  end
  self:_phase("chunks", function()
    self:_fill(k)
    self:_load(k)
  end)
  self.next_chunk = k + 1
  return { chunk = k, fills = self.fills[k], load = self.loads[k] }
end

--- Moves every remaining chunk, double-buffered. With `verify`, the verify
--- phase runs as soon as the last chunk is filled, while the runtime still
--- loads it, on the manifests the last fill's answers bring (run() does
--- so; the REPL steps verify on its own).
function Publication:chunks(verify)
  self:_phase("chunks", function()
    self:_move_chunks(self.next_chunk, verify)
  end)
  self.next_chunk = #self.plan.chunks + 1
end

-- Every agent's consumed manifest against the expected one: those the last
-- fill's `reports` brought (each its `consumed`), else the ones the agents
-- answer to verify. Returns them; raises VERIFY_FAILED naming the rank.
function Publication:_check_manifests(reports)
  local plan = self.plan
  local results = {}
  if reports then
    for index, report in ipairs(reports) do
      if type(report.consumed) ~= "table" then
        fail("VERIFY_FAILED", string.format("trainer rank %d answered the last fill without its consumed manifest",
          index - 1), { rank = index - 1 })
      end
      results[index] = report.consumed
    end
  else
    results = self.ranks:all("verify", function()
      return {}
    end, self.timeouts.verify)
  end
  for index, result in ipairs(results) do
    if result.manifest ~= plan.manifest then
      fail("VERIFY_FAILED", string.format("trainer rank %d exported manifest %s (%d tensors); expected %s (%d)",
        index - 1, result.manifest, result.tensors, plan.manifest, #plan.canonical), { rank = index - 1 })
    end
  end
  return results
end

-- The verify phase inside the chunks phase (Publication:chunks(true)): timed
-- and completed as verify, a failure named as verify's. `reports`: the last
-- fill's, with the manifests (else the ranks are asked).
function Publication:_verify_folded(reports)
  local started = now()
  local ok, result = pcall(self._check_manifests, self, reports)
  self.timings.verify = (self.timings.verify or 0) + (now() - started)
  if not ok then
    if errors.is(result) then
      result.folded_phase = "verify"
    end
    error(result, 0)
  end
  self.consumed = result
  self.completed.verify = true
end

--- Every agent's consumed manifest must equal the expected one.
function Publication:verify()
  self.consumed = self:_phase("verify", function()
    return self:_check_manifests()
  end)
  return self.consumed
end

-- The runtime's own time to commit the version (the vllm runtime's prefix
-- cache; the slowest replica's), or nil when it does not say.
local function commit_seconds(result)
  if result.replicas then
    local slowest = nil
    for _, answer in ipairs(result.replicas) do
      local seconds = tonumber(answer.commit_seconds)
      if seconds and (slowest == nil or seconds > slowest) then
        slowest = seconds
      end
    end
    return slowest
  end
  return tonumber(result.commit_seconds)
end

--- The runtime validates the workers' receipts and commits; the host
--- validates them again. With `release`, the runtime also releases (the
--- buffer policy, Publication:release) in the same answer (`released`), and
--- release asks nothing more of it (run() does so).
function Publication:finish(release)
  local header = self.header
  self.result = self:_phase("finish", function()
    if self.next_chunk <= #self.plan.chunks then
      fail("NOT_ALL_CHUNKS", string.format("finish with chunk %d of %d not moved", self.next_chunk,
        #self.plan.chunks))
    end
    local result = self.rollout:request("finish_update", {
      publication_id = header.publication_id, model_version = header.model_version, release = release or nil,
    })
    -- (With several replicas: each one's answer, against its part of the
    -- header; the version counts as committed only once all finished.)
    self.rollout:check_finish(header, result)
    self.timings.commit = commit_seconds(result)
    return result
  end)
  return self.result.receipts
end

--- Release per the buffer policy ("keep": buffers stay allocated and mapped
--- for the next publication; the runtime confirms it reads none of them),
--- then the host counts the version as committed. A runtime that released
--- in its finish answer (`released`) is not asked again.
function Publication:release()
  self:_phase("release", function()
    if not (self.result and self.result.released == true) then
      self.rollout:request("release", { publication_id = self.header.publication_id })
    end
  end)
  self.versions:commit(self.header.model_version)
  self.phase = "done"
  return self:report()
end

--- Which of the publication's phases run at once ({phases, within, why}),
--- as its chunks move: none when they move one at a time (`serial`).
---@return table[]
function Publication:overlaps()
  if self.serial then
    return {}
  end
  local overlaps
  if self.plan.gated and self.rollout.ordered then
    overlaps = { { phases = { "fill", "load" }, within = "chunks", why = "every fill and load is queued at once; the "
      .. "device runs fill 1, load 1, fill 2, ... in turn (buffers.order = \"device\")" } }
  else
    overlaps = {
      { phases = { "fill", "load" }, within = "chunks", why = self.plan.direct and "the runtime reads the trainer's "
        .. "storage: no load waits for a fill" or "chunk k+1 fills while chunk k loads" },
      { phases = { "verify", "load" }, within = "chunks", why = "the ranks' manifests come with the last fill's "
        .. "answers and are checked while the last chunk loads" },
    }
  end
  if self.starting then
    overlaps[#overlaps + 1] = { phases = { "start", "fill" }, within = "the publication", why = "the runtime's "
      .. "start_update is answered while chunk 1 fills; no chunk loads before it is" }
  end
  return overlaps
end

--- The publication's report (after release; of a failed one, what it
--- reached: no receipts, `committed` false, the phases it ran). `timings`
--- holds each phase's seconds, and `fill_copy` / `load_copy`: the seconds the
--- copies themselves took (the slowest rank's per chunk, the runtime's
--- slowest TP worker's); `overlaps` which phases run at once.
function Publication:report()
  local plan = self.plan
  self.timings.total = now() - self.started
  local header = self.header or {}
  return {
    model_version = header.model_version,
    publication_id = header.publication_id,
    step = self.step,
    manifest = plan.manifest,
    bytes = plan.bytes,
    chunks = #plan.chunks,
    timings = self.timings,
    gbps = plan.bytes / self.timings.total / 1e9,
    receipts = self.result and self.result.receipts,
    committed = self.phase == "done",
    overlaps = self:overlaps(),
    trace = self.trace,
  }
end

--- Runs every phase. Returns the report; raises PREFLIGHT (nothing moved) or
--- PUBLISH_FAILED (poisoned: the runtime's tree is destroyed, nothing
--- committed).
function Publication:run()
  self:preflight()
  self:init()
  self:start(not self.serial) -- (start_update answered while chunk 1 fills)
  self:chunks(true) -- (verify with the last load)
  self:finish(true) -- (release in finish's answer)
  return self:release()
end

return M
