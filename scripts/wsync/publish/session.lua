--- A publication session, the host's main job (`wsync run RECIPE` for a
--- recipe with a model): plan and check the schedule, open the agents'
--- control endpoint, start the synthetic trainer ranks, start the rollout
--- runtime on the ranks' devices in rank order, run the bootstrap, then for
--- every collective `publish` of the trainers run the memory schedule (the
--- publication inside it) and answer every rank with the same outcome.
---
--- The session orchestrates, and owns the phase, the rounds and the failure;
--- its parts are modules of their own: the opening's steps
--- (wsync.publish.opening), the ranks' connections, registration and the
--- publish collective (wsync.publish.registry), the synthetic trainer
--- processes (wsync.publish.trainers), the schedule's steps
--- (wsync.publish.steps), the runtime (wsync.publish.rollout), one
--- publication (wsync.publish.publication), the resident check
--- (wsync.publish.resident_check), the run report (wsync.publish.report),
--- what the session prints (wsync.publish.console) and a whole run with its
--- signals and verdict (wsync.publish.run).
local uv = require("luv")
local console = require("wsync.publish.console")
local errors = require("wsync.errors")
local loop = require("wsync.loop")
local output = require("wsync.output")
local plan_module = require("wsync.plan")
local publication_module = require("wsync.publish.publication")
local opening_module = require("wsync.publish.opening")
local registry_module = require("wsync.publish.registry")
local report_module = require("wsync.publish.report")
local resident_check_module = require("wsync.publish.resident_check")
local rollout_module = require("wsync.publish.rollout")
local run_module = require("wsync.publish.run")
local trainers_module = require("wsync.publish.trainers")
local transport_module = require("wsync.transport")
local versions_module = require("wsync.publish.versions")
local prepare_module = require("wsync.recipe.prepare")
local schedule_module = require("wsync.plan.schedule")
local steps_module = require("wsync.publish.steps")
local memory_probe = require("wsync.publish.memory_probe")
local timeouts_module = require("wsync.control.timeouts")
local process = require("wsync._process")

local M = {}

local say = console.say
local format_bytes = plan_module.format_bytes

---@class wsync.Session: wsync.RegistrySession
---@field registry wsync.Registry
---@field trainers wsync.Trainers
local Session = {}
Session.__index = Session

-- Every wait of a session is on its condition: `changed` wakes them all to
-- check again.
local function changed(session)
  session.condition:notify()
end

--- Where the session is, for a line that says what it waits for: "phase
--- chunks of model version 3, round 3", "phase runtime start".
---@return string
function Session:where()
  local publication = self.publication
  if self.phase == "publish" and publication then
    return string.format("phase %s of model version %s, round %d", publication.phase,
      publication.header and tostring(publication.header.model_version) or "(not yet numbered)", self.rounds + 1)
  end
  return "phase " .. self.phase .. (self.in_round and string.format(", round %d", self.rounds + 1) or "")
end

--- True once the session has served every publication its recipe asks for
--- (trainer.steps rounds, failed ones counted): from then on ranks may leave.
---@return boolean
function Session:steps_done()
  return self.rounds >= self.recipe.trainer.steps
end

--- Stops the session with `err`: nothing more is published, its verdict
--- fails (the first failure is the one reported); wakes every wait.
---@param err wsync.Error
function Session:fail(err)
  self.failure = self.failure or err
  self.stopped = self.stopped or err
  changed(self)
end

--- Runs schedule step `step` (the bootstrap's, a round's; wsync.publish.steps),
--- timed as a step of the round in progress, or of the opening.
---@param step table  a step of wsync.plan.schedule
function Session:run_step(step)
  self.phase = schedule_module.describe(step)
  self.schedule:run(step, self.round_report or self.report.opening, self.ranks, self.rollout)
end

--- The memory in use on every device of the run now (the ranks' and the
--- runtime's TP workers'), its processes named by their role: a sample of
--- wsync.publish.memory_probe, nil on the host backend (or where the driver
--- cannot say).
---@return table[]?
function Session:sample_memory(where)
  if self.recipe.backend ~= "cuda" or self.memory_unavailable then
    return nil
  end
  local probe = memory_probe.of_run(self.registry:state(self.trainers), self.rollout)
  local sample = probe:sample()
  if not sample then
    self.memory_unavailable = probe.unavailable
    say("device memory after each step is not reported: %s", tostring(probe.unavailable))
    return nil
  end
  return sample, where and self:predicted_bytes(where, sample)
end

--- Whether the schedule generates after its "publish" (a rank's publish may
--- then ask for what it generates).
---@return boolean
function Session:generates()
  local published = false
  for _, step in ipairs(self.steps) do
    published = published or step.kind == "publish"
    if published and step.kind == "generate" then
      return true
    end
  end
  return false
end

--- The model's bytes on a device after the step at `where` (the bootstrap's
--- and the first round's, then the steady state's: wsync.plan.schedule),
--- with vLLM's reservation taken from the total of the device `sample` names
--- first where the recipe did not give one (memory.device_bytes).
---@param where string
---@param sample table[]  wsync.publish.memory_probe's sample
---@return number?
function Session:predicted_bytes(where, sample)
  local report = self.memory_report
  if report.sizes.unmodelled and sample[1] and sample[1].total_bytes then
    if not self.run_memory_report then
      self.run_memory_report = prepare_module.check_schedule(self.recipe, self.plan, self.topology, nil,
        sample[1].total_bytes)
    end
    report = self.run_memory_report
  end
  return schedule_module.predicted_bytes(report, where, self.rounds > 0)
end

--- Spawns the session's runtime on the ranks' devices, in rank order
--- (wsync.publish.rollout's start): at the opening, and again after a
--- failed publication when the recipe respawns it.
---@return wsync.Rollout|wsync.ReplicaSet
function Session:spawn_rollout()
  return rollout_module.start(self.recipe, self.topology, (self.ranks:devices()), function()
    return self:where()
  end)
end

--- Opens a session: checks the plan and schedule, opens the endpoint,
--- starts the synthetic trainers (or waits for external ones), starts the
--- runtime on the ranks' devices in rank order, runs the bootstrap. Returns
--- when every rank may publish. Must run in a spawned coroutine.
---@param recipe table  a validated recipe with a model
---@return wsync.Session
---@param options {on_open: fun(session: table)?, on_listen: fun(path: string)?, publication: table?}?  on_open
---  sees the session before anything starts; on_listen gets the control endpoint's path once it listens;
---  publication: {trace: boolean?, serial: boolean?}, the options of every publication of the session
---  (wsync.PublicationContext), for benchmarks
function M.open(recipe, options)
  local started = uv.hrtime() / 1e9
  local plan, topology, memory_report, bootstrap, steps = prepare_module.prepare(recipe)
  local report = report_module.new({ recipe = recipe, plan = plan, topology = topology }, started)
  report_module.add_step(report.opening, { name = "plan", kind = "plan", seconds = uv.hrtime() / 1e9 - started })
  local session = setmetatable({
    recipe = recipe, plan = plan, topology = topology, timeouts = timeouts_module.with(recipe.timeouts),
    phase = "opening",
    transport = transport_module.for_backend(recipe.backend), versions = versions_module.new(),
    report = report, reports = report.rounds, rounds = 0,
    condition = loop.condition(), memory_report = memory_report,
    bootstrap = bootstrap, steps = steps,
  }, Session)
  session.schedule = steps_module.new(session.timeouts.callback)
  session.schedule:sample_memory_with(function(where)
    return session:sample_memory(where)
  end)
  session.registry = registry_module.new(session, { world = topology.world, plan = plan, steps = recipe.trainer.steps,
    announce = recipe.trainer.kind ~= "synthetic" })
  session.trainers = trainers_module.new(session)
  M.open_sessions[session] = true
  session.on_listen = options and options.on_listen
  session.publication_options = options and options.publication or {}
  if options and options.on_open then
    options.on_open(session)
  end
  say("recipe %s: %s, %d canonical tensors, %s in %d chunks (%s), manifest %s", recipe.name,
    plan.family, #plan.canonical, format_bytes(plan.bytes), #plan.chunks, console.buffers_shape(recipe, plan),
    plan.manifest)
  say("schedule checked: predicted peak %s per device at %s", format_bytes(memory_report.peak),
    memory_report.peak_step)
  local ok, err = pcall(function()
    opening_module.run(session)
    if session.stopped then -- a rank lost, or a malformed message, meanwhile
      error(session.stopped, 0)
    end
    session.ready = true
    session.ready_at = uv.hrtime() / 1e9
    session.phase = "ready"
    changed(session)
  end)
  report:end_opening()
  if not ok then
    session:fail(err)
    M.close(session)
    error(session.failure, 0)
  end
  return session
end

--- Waits until every rank called publish (true), or the session cannot go
--- on (false, and why: the session's failure; nothing when its steps are
--- done): its steps are done, it failed (a rank was lost, a malformed
--- message), or the ranks did not call publish in time: within
--- `timeouts.train_step` of the last answer no rank called it, or within
--- `timeouts.publish` of the first rank's call not every rank did
--- (wsync.publish.registry). Ranks already waiting in publish get the
--- failure: a publication needs every rank.
---@return boolean, wsync.Error?
function Session:wait_publish()
  self.phase = "waiting for publish"
  if self:steps_done() or self.stopped then
    return false, self.stopped
  end
  -- (The round's waits count from the last answer, or from when the session
  -- was ready: the training step.)
  local since = self.answered_at or self.ready_at or uv.hrtime() / 1e9
  local all, err = self.registry:await_publish(self.timeouts, self.report.published > 0)
  local waits = self.registry:waits(since)
  if all then
    self.waits = waits
    return true
  end
  self:fail(err)
  -- (The wait that failed is a round of the report: its seconds are the run's.)
  local round = self.report:begin_round(self.rounds + 1, waits)
  round.steps[#round.steps].outcome = "failed"
  self.report:end_round(round, self.stopped)
  self:answer(nil, self.stopped)
  return false, self.stopped
end

--- Runs the schedule steps before "publish" and returns the publication,
--- not yet run: `p:run()`, or its phases one by one from the REPL. Respawns
--- a poisoned runtime when the recipe says so.
---@return wsync.Publication
function Session:begin_round()
  -- (The round's report, with the waits for the ranks before it.)
  self.round_report = self.report:begin_round(self.rounds + 1, self.waits
    or self.registry:waits(self.answered_at or self.ready_at or uv.hrtime() / 1e9))
  self.waits = nil
  local poisoned = self.rollout.poisoned
  if poisoned then
    if not self.recipe.runtime.respawn then
      errors.raise("POISONED", "the runtime was destroyed by a failed publication and the recipe does not respawn "
        .. "it: " .. tostring(poisoned.message or poisoned))
    end
    say("respawning the runtime after the failed publication")
    self.rollout = report_module.timed(self.round_report, "runtime respawn", "start", function()
      return self:spawn_rollout()
    end)
  end
  self.in_round = true
  local step = self.registry:publishing_step(self.versions.committed)
  local request, shares = self.registry:generation_request()
  self.generation = request and { request = request, shares = shares } or nil
  self.schedule:generate_for(self.generation)
  self.round_report.step = step
  for index, schedule_step in ipairs(self.steps) do
    if schedule_step.kind == "publish" then
      self.after_publish = index + 1
      self.publish_where = schedule_step.where
      break
    end
    self:run_step(schedule_step)
  end
  self.phase = "publish"
  self.publication = publication_module.new({
    plan = self.plan, topology = self.topology, ranks = self.ranks, rollout = self.rollout, versions = self.versions,
    timeouts = self.timeouts, transport = self.transport.NAME, headroom_bytes = self.recipe.memory.headroom_bytes,
    step = step, trace = self.publication_options.trace, serial = self.publication_options.serial,
  })
  return self.publication
end

--- After the publication: checks resident slices when the recipe asks, runs
--- the schedule steps after "publish", answers every rank. Returns the report.
---@param publication wsync.Publication
function Session:end_round(publication)
  local report = publication:report()
  local round = self.round_report
  -- Committed: it is in the report even if a later step of the round fails.
  self.report:add_publication(round, report, "ok", self.publish_where)
  local entry = round.steps[#round.steps]
  entry.device_memory, entry.predicted_bytes = self:sample_memory(self.publish_where)
  local mode = require("wsync.recipe").verify_mode(self.recipe)
  if mode then
    self.resident_check = self.resident_check or resident_check_module.new({ mode = mode, plan = self.plan,
      tp = self.topology.tp, ranks = self.ranks, transport = self.transport, timeouts = self.timeouts })
    round.verified = report_module.timed(round, "resident_check", "check", function()
      return self.resident_check:check(self.rollout, publication.step)
    end)
    report.verified = round.verified
  end
  say("published %s", console.publication(report))
  for index = self.after_publish, #self.steps do
    self:run_step(self.steps[index])
  end
  -- (A session that streams requests, rollout.stream: what they produced.)
  if self.recipe.rollout then
    say("%s", console.stream(round.round, self.rollout:request("poll", {})))
  end
  self:answer({ model_version = report.model_version, publication_id = report.publication_id,
    receipts = #report.receipts, manifest = report.manifest })
  return round
end

--- How many rounds a session keeps in its `reports` (the newest): a long run
--- must not grow with its publication count (wsync.publish.report).
M.KEPT_REPORTS = report_module.KEPT_ROUNDS

--- Answers every rank waiting in publish with `result` or `err`; the round
--- in progress, if any, has ended (a step of the session's trainer.steps).
function Session:answer(result, err)
  -- The round in progress ends: reported, and in the ranks' answer.
  local round = self.round_report
  if round then
    self.round_report = nil
    self.report:end_round(round, err)
    if result then
      -- (As JSON text: the ranks pass it on as it is, sorted keys and all.)
      result.report = require("wsync.util").json(report_module.round_json(round))
    end
  end
  self.answered_at = uv.hrtime() / 1e9
  self.registry:answer(result, err, result and self:generations())
  self.generation = nil
  self.schedule:generate_for(nil)
  if self.in_round then
    self.in_round = false
    self.rounds = self.rounds + 1
  end
  self.publication = nil
  self.phase = "ready"
  changed(self)
end

--- By rank, the `generation` of its answer (JSON text: {model_version,
--- outputs}, its own prompts' outputs) when it asked its publish to
--- generate and the schedule's "generate" step ran; nil when none asked.
---@return table<integer, table>?
function Session:generations()
  local generation = self.generation
  if not (generation and generation.answer) then
    return nil
  end
  local outputs = generation.answer.outputs or {}
  local util = require("wsync.util")
  local per_rank = {}
  for rank, share in pairs(generation.shares) do
    local own = util.json_array({})
    for index = share.first, share.first + share.count - 1 do
      own[#own + 1] = outputs[index]
    end
    per_rank[rank] = { generation = util.json({ model_version = generation.answer.model_version, outputs = own }) }
  end
  return per_rank
end

--- One whole round: schedule, publication, answers. A failure poisons (when
--- it is not already a poisoned publication), is answered to every rank, and
--- is returned.
---@return table|nil report, wsync.Error? failure
function Session:round()
  local ok, result = pcall(function()
    local publication = self:begin_round()
    publication:run()
    return self:end_round(publication)
  end)
  if ok then
    return result
  end
  if not errors.is(result) then
    result = errors.new("PUBLISH_FAILED", tostring(result), { cause = "LUA_ERROR" })
  end
  local round = self.round_report
  if round and self.publication and not round.timings then
    -- (The publication failed: its report, as far as it went.)
    self.report:add_publication(round, self.publication:report(), "failed", self.publish_where)
  end
  -- Whatever failed (a schedule step, a check after the commit, a bug), the
  -- runtime's state is no longer known: fail-stop.
  if not self.rollout.poisoned then
    self.rollout:destroy(result)
  end
  self.failure = self.failure or result
  -- A rank may go on to its next step only when a new runtime will take it,
  -- every rank is still there, and with its memory back: the failed round
  -- stopped mid-schedule.
  if self.recipe.runtime.respawn and self.rollout.poisoned and not self.registry:any_lost() then
    result.respawn = pcall(function()
      for _, step in ipairs(self.schedule:onloads("after the failed publication")) do
        self:run_step(step)
      end
    end) or nil
  end
  if not result.respawn then
    self.stopped = self.stopped or result
  end
  -- The failure is printed once: in full here when the session goes on with
  -- a new runtime, in the verdict when it stops.
  local what = string.format("round %d%s failed", self.rounds + 1, round and round.model_version
    and string.format(" (model version %d)", round.model_version) or "")
  if result.respawn then
    say("%s; the runtime is respawned for the next round: %s", what, tostring(result))
  else
    say("%s%s%s: stopping the session, fail-stop (the verdict says why)", what, result.phase and (" in "
      .. result.phase) or "", result.rank and (", rank " .. result.rank) or "")
  end
  self:answer(nil, result)
  return nil, result
end

--- A read-only snapshot for `wsync repl --attach` and the REPL: each rank
--- says whether it waits in publish, and why it was lost and how its process
--- exited (a synthetic rank) when it was; `failure` the session's.
function Session:state()
  local publication, rollout = self.publication, self.rollout
  local poisoned = rollout and rollout.poisoned
  return {
    recipe = self.recipe.name, phase = self.phase, model_version = self.versions.committed,
    plan = plan_module.summary(self.plan), ranks = self.registry:state(self.trainers),
    runtime = rollout and rollout:state() or nil,
    publication = publication and { phase = publication.phase, model_version = publication.header
      and publication.header.model_version, next_chunk = publication.next_chunk } or nil,
    publications = self.report.published, poisoned = poisoned and tostring(poisoned.message or poisoned),
    failure = self.failure and tostring(self.failure),
  }
end

-- Removes the names of the ranks' packed buffers (a mapping that still
-- exists stays valid): those the ranks reported, and any buffer a synthetic
-- trainer created before it could report it. Says what could not be removed.
local function remove_buffers(session)
  local descriptors = session.ranks and session.ranks.descriptors
  local _, failures = session.transport.remove_leftovers(descriptors, session.trainers:pids())
  for _, failure in ipairs(failures) do
    say("cannot remove packed buffer %s: %s", failure.name, failure.message)
  end
end

--- Sessions opened and not closed yet (the REPL closes them when it ends).
M.open_sessions = setmetatable({}, { __mode = "k" })

--- Closes every open session (inside a coroutine of wsync.loop.spawn).
function M.close_all()
  for session in pairs(M.open_sessions) do
    local ok, err = pcall(M.close, session)
    if not ok then
      io.stderr:write("wsync: closing a session failed: " .. tostring(err) .. "\n")
    end
  end
end

--- Stops at once for a signal (Ctrl-C or SIGTERM during `wsync run`), from a
--- signal callback: kills the runtime's process group and the synthetic
--- trainers, removes the packed buffers' names and the control endpoint.
--- Nothing more is published; the caller exits right after.
---@param session table
---@param signal_name string
function M.abort(session, signal_name)
  say("%s: stopping now; the runtime and the synthetic trainers are killed, nothing more is published",
    signal_name)
  for _, client in ipairs(session.rollout and session.rollout:clients() or {}) do
    if client.group then
      process.signal_group(client.group, "SIGKILL")
    end
  end
  -- A killed trainer may still be inside a system call that creates a
  -- buffer's name (the signal acts when it returns): scan for names only
  -- once every killed trainer is gone or a zombie.
  session.trainers:kill_now()
  remove_buffers(session)
  -- (The run report's file is completed: the round in progress, failed.)
  local interrupted = errors.new("INTERRUPTED", signal_name .. ": the run was stopped")
  if session.round_report then
    session.report:end_round(session.round_report, interrupted)
    session.round_report = nil
  end
  session.report:finish(interrupted)
  if session.endpoint then
    -- Not close(): that would fail the requests in flight and wake the
    -- coroutines waiting on them; the process exits instead.
    for _, failure in ipairs(session.endpoint:remove_files()) do
      say("%s", failure)
    end
  end
end

--- Ends the session's work: ranks waiting in publish get the failure, if
--- any, and every rank still connected is told it (it raises it from its
--- next publish); then the ranks get `timeouts.shutdown` to leave by
--- themselves: a synthetic rank exits, an external one disconnects. A rank
--- that was lost need not leave: M.close kills what is left.
function Session:finish()
  report_module.timed(self.report:begin_closing(), "ranks leave", "wait", function()
    self.phase = "ending"
    if self.stopped then
      self:answer(nil, self.stopped)
      self.registry:tell_failure(self.stopped, self.timeouts.shutdown)
    end
    -- (When they did not all leave, M.close does not wait again: it closes
    -- the connections that are still open and kills the synthetic ranks
    -- that are still running.)
    self.lingering = not self.registry:await_leaving(self.timeouts.shutdown, self.trainers)
  end)
end

--- Closes everything the session started: runtime, endpoint, trainer
--- processes (a synthetic rank still running is killed with SIGKILL and
--- reaped), buffer names. Every wait in it is bounded.
function M.close(session)
  session.phase = "closing"
  M.open_sessions[session] = nil
  local closing = session.report:begin_closing()
  if session.rollout then
    report_module.timed(closing, "runtime shutdown", "close", function()
      session.rollout:close()
    end)
  end
  if session.endpoint then
    -- (A rank's request woken by the failure answers it in this turn of the
    -- loop, perhaps after this: let it, so that the rank hears why, not only
    -- that the connection closed.)
    loop.sleep(0)
    for _, failure in ipairs(session.endpoint:close()) do
      say("%s", failure)
    end
  end
  -- The ranks heard the end (their connections closed): a moment to exit by
  -- themselves unless the session already waited, then SIGKILL. A rank lost
  -- before a failure gets no moment: it may be stopped, or hung.
  local seconds = session.trainers:stop(not session.lingering, function(rank)
    return session.stopped ~= nil and session.registry:lost_before_stop(rank)
  end)
  if seconds then
    report_module.add_step(closing, { name = "trainers exit", kind = "wait", seconds = seconds })
  end
  -- A rank killed mid-publication never unlinks its packed buffers. Synthetic
  -- ranks have exited by now and external ones are disconnected: a name still
  -- there is a leftover.
  remove_buffers(session)
  -- The last lines of the processes that ended, before anything the host
  -- says after the session.
  output.drain(2)
  session.report:end_closing()
  session.phase = "closed"
end
Session.close = M.close

--- Runs a model recipe to the end (wsync.publish.run): Ctrl-C and SIGTERM
--- abort it; the closing report and the verdict end it. Returns the
--- session's reports; raises the first failure after everything was closed.
---@param recipe table
---@param options {signals: boolean?, on_open: fun(session: table)?, on_listen: fun(path: string)?,
---  report_file: file*?, publication: table?}?
---  signals = false installs no SIGINT/SIGTERM handler (an embedding host's session); on_open,
---  on_listen and publication as in M.open; report_file: the run report's file (wsync.publish.report),
---  written as the run goes and closed at its end, also when it fails
---@return table[]
function M.run(recipe, options)
  return run_module.run(M, recipe, options)
end

return M
