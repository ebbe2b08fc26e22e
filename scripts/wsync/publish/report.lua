--- The run report: where a session's time goes, round by round. One
--- structure for the closing report's text, the machine-readable run report
--- (`wsync run RECIPE --report FILE.json`, written as the run goes and also
--- when it fails) and Python (`Host.reports()`, and the `Publication` that
--- `Agent.publish()` returns).
---
--- A session has an opening, rounds and a closing, each a list of steps: a
--- step is `{name, kind, where, started, seconds, bytes, device_memory, outcome}`
--- (`started`: when it began, in seconds of the monotonic clock (uv.hrtime,
--- CLOCK_MONOTONIC, which Python's time.monotonic() reads too); `bytes`: what
--- it moved, when known; `device_memory`: on the cuda backend, the memory in
--- use on every device of the run after the step, as the driver sees it
--- (wsync.publish.memory_probe): `{{device, used_bytes, total_bytes,
--- processes = {{pid, role, used_bytes}} or null}}`; null on the host
--- backend, or where the driver's library is missing). A round is
--- one collective publish of the trainer ranks, FAILED ones included:
---
--- - its waits for the ranks: `train_step` (from the last answer, or the
---   session's start, to the first rank's call of publish: the training
---   step) and `publish_wait` (from then to the last rank's call);
--- - every schedule step before "publish" (trainer callbacks, sleep, wake,
---   generate, pause, resume), named as `wsync check` names them;
--- - `publish`: the publication, whose own phases are the round's `timings`
---   (preflight, init, start, chunks, fill, load, verify, finish, release,
---   total; fill_copy and load_copy: the copies alone; commit: the
---   runtime's own commit within finish, when it says), and which ones of
---   them run at once (`overlaps`: fill and load of consecutive chunks do);
--- - `resident_check`: the check of every resident slice (`verify`);
--- - every schedule step after "publish";
---
--- with its outcome ("ok" or "failed"), its error and its seconds (from the
--- end of the round before to its answer: the steps add up to it). Rounds are
--- kept in memory up to M.KEPT_ROUNDS (a long run must not grow); the file
--- holds every one, and `totals` adds every step's seconds up by name.
local uv = require("luv")
local errors = require("wsync.errors")
local memory_probe = require("wsync.publish.memory_probe")
local util = require("wsync.util")

local M = {}

--- The run report's schema: its name, and a version that changes with any
--- change of a key's meaning or a key removed (keys added keep it).
M.SCHEMA = "wsync-run-report"
M.SCHEMA_VERSION = 1

--- How many rounds a report keeps in memory (the newest): Host.reports(), the
--- closing report's table. The file and the totals have them all.
M.KEPT_ROUNDS = 32

--- The publication's phases, in order, as `timings` names them (`chunks` is
--- the wall time of moving every chunk; `fill` and `load` add up each
--- chunk's fill and load, which overlap).
M.PHASES = { "preflight", "init", "start", "chunks", "fill", "load", "verify", "finish", "release" }

-- Every key of a round's `timings`: the phases, then the totals and the
-- copies alone (the module's header says what each is).
local TIMINGS = { unpack(M.PHASES) }
for _, extra in ipairs({ "total", "fill_copy", "load_copy", "commit" }) do
  TIMINGS[#TIMINGS + 1] = extra
end

local null = util.json_null

local function now()
  return uv.hrtime() / 1e9
end

-- A section's steps ------------------------------------------------------------

-- A new section (the opening, a round, the closing): its steps and when it
-- started.
local function section(started)
  return { started = started or now(), steps = {} }
end

--- Adds step `entry` ({name, kind, where?, started?, seconds, bytes?,
--- outcome?}) to `target` (a round, the opening or the closing;
--- `report.opening`...). An entry without `started` is one that ends now.
---@param target table
---@param entry table
function M.add_step(target, entry)
  entry.outcome = entry.outcome or "ok"
  entry.started = entry.started or now() - (entry.seconds or 0)
  target.steps[#target.steps + 1] = entry
  return entry
end

--- Runs `fn()` as step `name` of `target`, timed: added with its seconds,
--- also when it raises (outcome "failed"; the error goes on). Returns what
--- `fn` returned.
---@param target table
---@param name string
---@param kind string
---@param fn fun(): any
---@param fields table?  where, bytes
function M.timed(target, name, kind, fn, fields)
  local started = now()
  local results = util.pack(pcall(fn))
  local entry = { name = name, kind = kind, started = started, seconds = now() - started,
    outcome = results[1] and "ok" or "failed" }
  for key, value in pairs(fields or {}) do
    entry[key] = value
  end
  M.add_step(target, entry)
  if not results[1] then
    error(results[2], 0)
  end
  return unpack(results, 2, results.n)
end

-- The report -------------------------------------------------------------------------

---@class wsync.RunReport
---@field opening table   {started, steps, seconds}
---@field rounds table[]  the newest M.KEPT_ROUNDS rounds
---@field closing table   {started, steps, seconds}
---@field count integer   rounds so far
---@field totals table<string, number>  every round step's seconds, added up by name
local Report = {}
Report.__index = Report

--- A report of a session that opens now (or at `started`, seconds of
--- uv.hrtime). `about` says what ran: {recipe, plan, topology} (a validated
--- recipe, its plan, its topology).
---@param about {recipe: table, plan: table?, topology: table?}
---@param started number?
---@return wsync.RunReport
function M.new(about, started)
  return setmetatable({
    about = about, started = started or now(), opening = section(started), rounds = {}, count = 0, published = 0,
    totals = {}, total_seconds = 0, closing = nil,
  }, Report)
end

--- Starts round `number` (the session's next), with the waits that came
--- before it ({train_step = s, publish_wait = s}, from `started`, seconds of
--- uv.hrtime).
---@param number integer
---@param waits {train_step: number?, publish_wait: number?, started: number?}?
---@return table round
function Report:begin_round(number, waits)
  waits = waits or {}
  local round = section(waits.started)
  round.round = number
  for _, name in ipairs({ "train_step", "publish_wait" }) do
    if waits[name] then
      M.add_step(round, { name = name, kind = "wait", seconds = waits[name] })
    end
  end
  return round
end

--- Takes what publication `report` (wsync.publish.publication's report(),
--- also of one that failed) says into `round`, with its step (`publish`,
--- `where`: the schedule's words for it).
---@param round table
---@param report table
---@param outcome "ok"|"failed"
---@param where string?
function Report:add_publication(round, report, outcome, where)
  for _, key in ipairs({ "model_version", "publication_id", "manifest", "chunks", "timings", "receipts", "overlaps",
    "trace" }) do
    round[key] = report[key]
  end
  round.committed = report.committed
  -- (What it moved, and how fast: of a committed publication only.)
  round.bytes = report.committed and report.bytes or nil
  round.gbps = report.committed and report.gbps or nil
  M.add_step(round, { name = "publish", kind = "publish", where = where, seconds = report.timings.total,
    bytes = outcome == "ok" and report.bytes or nil, outcome = outcome })
  if round.committed then
    self.published = self.published + 1
  end
end

--- Ends `round` with its outcome (`err` nil: ok): its seconds run to now.
--- Keeps it (the newest M.KEPT_ROUNDS), adds its steps to the totals, and
--- writes it to the report's file.
---@param round table
---@param err any
function Report:end_round(round, err)
  round.seconds = now() - round.started
  round.outcome = err == nil and "ok" or "failed"
  round.error = err ~= nil and M.error_fields(err) or nil
  self.count = self.count + 1
  self.rounds[#self.rounds + 1] = round
  if #self.rounds > M.KEPT_ROUNDS then
    table.remove(self.rounds, 1)
  end
  for _, step in ipairs(round.steps) do
    self.totals[step.name] = (self.totals[step.name] or 0) + step.seconds
  end
  self.total_seconds = self.total_seconds + round.seconds
  if self.file then
    self:_write_head()
    self.file:write(self.wrote_round and ",\n" or "\n", util.json(M.round_json(round)))
    self.file:flush()
    self.wrote_round = true
  end
end

--- Ends the opening (its seconds run to now).
function Report:end_opening()
  self.opening.seconds = now() - self.opening.started
end

--- Starts the closing: its steps follow.
---@return table closing
function Report:begin_closing()
  self.closing = self.closing or section()
  return self.closing
end

--- Ends the closing (its seconds run to now).
function Report:end_closing()
  if self.closing then
    self.closing.seconds = now() - self.closing.started
  end
end

--- An error as a report holds it: its code, message, phase, rank (and where
--- a recipe's error points).
---@param err any
---@return table
function M.error_fields(err)
  if not errors.is(err) then
    return { code = "LUA_ERROR", message = tostring(err) }
  end
  local fields = {}
  for _, key in ipairs({ "code", "message", "phase", "rank", "file", "line", "field", "cause" }) do
    fields[key] = err[key]
  end
  return fields
end

-- JSON ------------------------------------------------------------------------------

-- A JSON array of `convert(item)` for each of `items`; null for no list.
local function json_list(items, convert)
  if not items then
    return null
  end
  local out = util.json_array({})
  for index, item in ipairs(items) do
    out[index] = convert(item)
  end
  return out
end

local function memory_json(sample)
  return json_list(sample, function(entry)
    return { device = entry.device, used_bytes = entry.used_bytes, total_bytes = entry.total_bytes,
      processes = json_list(entry.processes, function(process)
        return { pid = process.pid, role = process.role, used_bytes = process.used_bytes or null }
      end) }
  end)
end

-- A together step's part (wsync.publish.steps): its name, kind, start,
-- seconds, bytes and outcome.
local function together_part_json(part)
  return { name = part.name, kind = part.kind, started = part.started or null, seconds = part.seconds,
    bytes = part.bytes or null, outcome = part.outcome }
end

local function step_json(step)
  return { name = step.name, kind = step.kind, where = step.where or null, started = step.started or null,
    seconds = step.seconds, bytes = step.bytes or null, device_memory = memory_json(step.device_memory),
    predicted_bytes = step.predicted_bytes or null, outcome = step.outcome,
    parts = json_list(step.parts, together_part_json) }
end

local function steps_json(steps)
  return json_list(steps or {}, step_json)
end

local function or_null(value)
  if value == nil then
    return null
  end
  return value
end

--- Round `round` as the run report, Python and the ranks' answers give it:
--- every key present (null when it does not apply), ready for util.json.
---@param round table
---@return table
function M.round_json(round)
  local timings = {}
  for _, name in ipairs(TIMINGS) do
    timings[name] = or_null(round.timings and round.timings[name])
  end
  local error_json = round.error and util.merged(round.error) or null
  local overlaps = util.json_array({})
  for index, overlap in ipairs(round.overlaps or {}) do
    overlaps[index] = { phases = util.json_array({ unpack(overlap.phases) }), within = overlap.within,
      why = overlap.why }
  end
  return {
    round = round.round, step = or_null(round.step), outcome = round.outcome or "running", error = error_json,
    seconds = or_null(round.seconds), steps = steps_json(round.steps),
    model_version = or_null(round.model_version), publication_id = or_null(round.publication_id),
    committed = round.committed == true, manifest = or_null(round.manifest), bytes = or_null(round.bytes),
    chunks = or_null(round.chunks), gbps = or_null(round.gbps), timings = timings, overlaps = overlaps,
    receipts = round.receipts and util.json_array({ unpack(round.receipts) }) or util.json_array({}),
    verified = or_null(round.verified),
  }
end

-- The section `part` (the opening or the closing) as JSON.
local function part_json(part)
  if not part then
    return null
  end
  return { seconds = or_null(part.seconds), steps = steps_json(part.steps) }
end

-- What ran: the recipe and its plan, as the file's head says.
local function about_json(about)
  local recipe, plan, topology = about.recipe or {}, about.plan, about.topology
  local out = {
    recipe = { name = or_null(recipe.name), path = or_null(about.path or recipe.path),
      backend = or_null(recipe.backend) },
    plan = null,
  }
  if recipe.model and topology then
    out.recipe.trainer = { kind = recipe.trainer.kind, ranks = topology.world, steps = recipe.trainer.steps }
    out.recipe.runtime = { kind = recipe.runtime.kind, tp = topology.tp, replicas = topology.replicas or 1 }
    out.recipe.verify = or_null(recipe.verify)
  end
  if plan then
    out.plan = { family = plan.family, tensors = #plan.canonical, bytes = plan.bytes, chunks = #plan.chunks,
      manifest = plan.manifest, buffers = recipe.buffers and recipe.buffers.direct and "direct"
        or { count = plan.buffer_count, bytes = plan.buffer_bytes } }
  end
  return out
end

--- Writes the report to `file` (an open file) as the run goes: the head
--- once the opening ended (or at the end), each round as it ends, the rest
--- at `finish`. The report closes the file at `finish`.
---@param file file*
function Report:write_to(file)
  self.file = file
end

-- The keys before "rounds" (sorted: "opening", "plan", "recipe"), once.
function Report:_write_head()
  if self.wrote_head then
    return
  end
  self.wrote_head = true
  local about = about_json(self.about)
  self.file:write(string.format('{"opening":%s,"plan":%s,"recipe":%s,"rounds":[', util.json(part_json(self.opening)),
    util.json(about.plan), util.json(about.recipe)))
end

--- What the whole run came to: its outcome and error, the rounds, how many
--- versions were published, its seconds and how many of them the steps
--- account for, every step's seconds added up by name.
---@return table
function Report:summary()
  local seconds = (self.finished or now()) - self.started
  local accounted = 0
  for _, part in ipairs({ self.opening, self.closing }) do
    for _, step in ipairs(part and part.steps or {}) do
      accounted = accounted + step.seconds
    end
  end
  for _, value in pairs(self.totals) do
    accounted = accounted + value
  end
  return { outcome = self.outcome or "running", error = self.error, rounds = self.count, published = self.published,
    seconds = seconds, accounted_seconds = accounted, totals = self.totals }
end

--- Ends the report with the run's outcome (`err` nil: ok): the closing ends
--- now; the file, if any, is completed and closed.
---@param err any
function Report:finish(err)
  if self.finished then
    return
  end
  self.finished = now()
  if self.closing and not self.closing.seconds then
    self.closing.seconds = self.finished - self.closing.started
  end
  self.outcome = err == nil and "ok" or "failed"
  self.error = err ~= nil and M.error_fields(err) or nil
  if not self.file then
    return
  end
  self:_write_head()
  local summary = self:summary()
  summary.error = or_null(summary.error)
  summary.closing = part_json(self.closing)
  self.file:write(string.format('\n],"run":%s,"schema":%s,"schema_version":%d,"wsync":%s}\n', util.json(summary),
    util.json(M.SCHEMA), M.SCHEMA_VERSION, util.json(require("wsync").build)))
  self.file:close()
  self.file = nil
end

--- Writes a report of a run that never opened a session (its recipe was
--- refused, or it has no model) to `file` and closes it.
---@param file file*
---@param about {recipe: table?, path: string?}
---@param err any  nil: the run ended well
---@param started number?  when the run started (seconds of uv.hrtime)
function M.write_unopened(file, about, err, started)
  local report = M.new(about, started)
  report.opening = nil
  report:write_to(file)
  report:finish(err)
end

-- Text ---------------------------------------------------------------------------------

local function ms(seconds)
  return seconds and string.format("%.1f", seconds * 1e3) or "-"
end

-- A row of `cells` in columns of `widths`, the last one as it is.
local function row(cells, widths)
  local parts = {}
  for index, cell in ipairs(cells) do
    parts[index] = index < #cells and string.format("%-" .. widths[index] .. "s", cell) or cell
  end
  return table.concat(parts, " ")
end

-- The distinct values that `values(step)` lists over the steps of the rounds
-- kept, in the order they first come.
local function distinct_step_values(rounds, values)
  local distinct, seen = {}, {}
  for _, round in ipairs(rounds) do
    for _, step in ipairs(round.steps) do
      for _, value in ipairs(values(step)) do
        util.append_unseen(distinct, seen, value)
      end
    end
  end
  return distinct
end

-- The names of the steps of the rounds kept, in the order they first come.
local function step_names(rounds)
  return distinct_step_values(rounds, function(step)
    return { step.name }
  end)
end

local GIB = 1024 ^ 3

-- The devices that the rounds' memory samples name, in the order first met.
local function sampled_devices(rounds)
  return distinct_step_values(rounds, function(step)
    return util.field_values(step.device_memory or {}, "device")
  end)
end

-- Round `round`'s memory in use after the last step `name`, in GiB on each
-- of `devices` ("12.34", "12.34/11.02"), or "-".
local function step_memory(round, name, devices)
  local sample
  for _, step in ipairs(round.steps) do
    if step.name == name then
      sample = step.device_memory or sample
    end
  end
  if not sample then
    return "-"
  end
  local cells = {}
  for index, device in ipairs(devices) do
    cells[index] = "-"
    for _, entry in ipairs(sample) do
      if entry.device == device then
        cells[index] = string.format("%.2f", entry.used_bytes / GIB)
      end
    end
  end
  return table.concat(cells, "/")
end

-- The memory tables of the closing report: each round's memory in use after
-- each step, then the processes holding it after the last round's steps.
local function memory_lines(lines, rounds, names)
  local devices = sampled_devices(rounds)
  if #devices == 0 then
    return
  end
  lines[#lines + 1] = string.format("device memory in use after each step (GiB; %s: %s):",
    #devices == 1 and "device" or "devices, in this order", table.concat(devices, ", "))
  local header, widths = { "round", "version" }, {}
  for _, name in ipairs(names) do
    header[#header + 1] = name
  end
  for index, cell in ipairs(header) do
    widths[index] = math.max(#cell, index <= 2 and 7 or 6 * #devices)
  end
  lines[#lines + 1] = row(header, widths)
  for _, round in ipairs(rounds) do
    local cells = { tostring(round.round), round.model_version and tostring(round.model_version) or "-" }
    for _, name in ipairs(names) do
      cells[#cells + 1] = step_memory(round, name, devices)
    end
    lines[#lines + 1] = row(cells, widths)
  end
  local last = rounds[#rounds]
  lines[#lines + 1] = string.format("what holds it after each step of round %d (GiB, by process):", last.round)
  for _, step in ipairs(last.steps) do
    for _, entry in ipairs(step.device_memory or {}) do
      lines[#lines + 1] = string.format("  %s, %s: %s", step.name, entry.device,
        memory_probe.describe(entry))
    end
  end
end

-- The most that one device of `sample` has in use.
local function most_used(sample)
  local most = 0
  for _, entry in ipairs(sample) do
    most = math.max(most, entry.used_bytes)
  end
  return most
end

--- How far a step's measured memory is from the model's prediction, against
--- what the model promises (within 5% of the prediction or 1 GiB, the
--- larger): {measured, predicted, percent, ratio (over 1: outside)}, or nil
--- where the step has no sample or no prediction.
---@param step table  a step of a round
function M.memory_error(step)
  if not (step.device_memory and step.predicted_bytes) then
    return nil
  end
  local measured, predicted = most_used(step.device_memory), step.predicted_bytes
  return { measured = measured, predicted = predicted,
    percent = predicted > 0 and (measured - predicted) / predicted * 100 or 0,
    ratio = math.abs(measured - predicted) / math.max(0.05 * predicted, GIB) }
end

-- The model against the measurement (wsync.plan.schedule): each step of the
-- last round, then the step furthest outside what the model promises over
-- all rounds, in one line a program can find.
local function prediction_lines(lines, rounds)
  local worst, worst_round
  for _, round in ipairs(rounds) do
    for _, step in ipairs(round.steps) do
      local off = M.memory_error(step)
      if off and (not worst or off.ratio > worst.off.ratio) then
        worst, worst_round = { step = step, off = off }, round.round
      end
    end
  end
  if not worst then
    return
  end
  local last = rounds[#rounds]
  lines[#lines + 1] = string.format("the memory model against the device after each step of round %d (GiB, the most "
    .. "loaded device):", last.round)
  for _, step in ipairs(last.steps) do
    local off = M.memory_error(step)
    if off then
      lines[#lines + 1] = string.format("  %-18s predicted %7.2f, measured %7.2f (%+.1f %%)", step.name,
        off.predicted / GIB, off.measured / GIB, off.percent)
    end
  end
  local off = worst.off
  lines[#lines + 1] = string.format("schedule memory: worst step %s (round %d): predicted %.2f GiB, measured %.2f GiB "
    .. "(%+.1f %%), %s 5%% or 1 GiB", worst.step.name, worst_round, off.predicted / GIB, off.measured / GIB,
    off.percent, off.ratio <= 1 and "within" or "outside")
end

-- Round `round`'s seconds of step `name` (added up when it ran twice), and
-- whether it failed there.
local function step_seconds(round, name)
  local seconds, failed = nil, false
  for _, step in ipairs(round.steps) do
    if step.name == name then
      seconds = (seconds or 0) + step.seconds
      failed = failed or step.outcome == "failed"
    end
  end
  return seconds, failed
end

-- Where a failed round failed, in a few words: "failed in chunks, rank 1".
local function failed_where(round)
  local err = round.error or {}
  local where = {}
  if err.phase then
    where[#where + 1] = "in " .. err.phase
  end
  if err.rank then
    where[#where + 1] = "rank " .. err.rank
  end
  return "FAILED" .. (#where > 0 and (" " .. table.concat(where, ", ")) or "")
end

-- "registration 0.50 s, runtime start 1.20 s": a part's steps, in order.
local function list_steps(steps)
  local parts = {}
  for _, step in ipairs(steps) do
    parts[#parts + 1] = string.format("%s %.2f s%s", step.name, step.seconds, step.outcome == "failed" and " (failed)"
      or "")
  end
  return table.concat(parts, ", ")
end

--- The closing report's lines about time (without the "wsync: " prefix): the
--- rounds' steps (ms, in schedule order), each publication's phases, what
--- overlaps, and where the whole run's seconds went.
---@return string[]
function Report:text_lines()
  local lines = {}
  local rounds = self.rounds
  if self.count > #rounds then
    lines[#lines + 1] = string.format("the last %d of %d rounds:", #rounds, self.count)
  end
  if #rounds > 0 then
    -- Every round's steps, one column each.
    local names = step_names(rounds)
    local header = { "round", "version", "step", "total ms" }
    for _, name in ipairs(names) do
      header[#header + 1] = name
    end
    header[#header + 1] = "outcome"
    local widths = {}
    for index, cell in ipairs(header) do
      widths[index] = math.max(#cell, index <= 3 and 7 or 8)
    end
    lines[#lines + 1] = "steps of each round (ms; the waits for the trainer ranks first):"
    lines[#lines + 1] = row(header, widths)
    for _, round in ipairs(rounds) do
      local cells = { tostring(round.round), round.model_version and tostring(round.model_version) or "-",
        round.step and tostring(round.step) or "-", ms(round.seconds) }
      for _, name in ipairs(names) do
        local seconds, failed = step_seconds(round, name)
        cells[#cells + 1] = ms(seconds) .. (failed and "!" or "")
      end
      cells[#cells + 1] = round.outcome == "ok" and "ok" or failed_where(round)
      lines[#lines + 1] = row(cells, widths)
    end
    memory_lines(lines, rounds, names)
    prediction_lines(lines, rounds)
    -- Each publication's phases.
    header = { "version", "step", "bytes", "total ms" }
    for _, phase in ipairs(M.PHASES) do
      header[#header + 1] = phase
    end
    header[#header + 1] = "GB/s"
    header[#header + 1] = "receipts"
    widths = {}
    for index, cell in ipairs(header) do
      widths[index] = math.max(#cell, index == 2 and 5 or 9)
    end
    lines[#lines + 1] = "publication phases (ms; fill and load add up each chunk's, and overlap: see below):"
    lines[#lines + 1] = row(header, widths)
    local overlaps = nil
    for _, round in ipairs(rounds) do
      if round.timings then
        local t = round.timings
        local cells = { round.model_version and tostring(round.model_version) or "-",
          round.step and tostring(round.step) or "-", round.committed and tostring(round.bytes) or "-", ms(t.total) }
        for _, phase in ipairs(M.PHASES) do
          cells[#cells + 1] = ms(t[phase])
        end
        cells[#cells + 1] = round.committed and string.format("%.3f", round.gbps) or "-"
        if round.committed then
          cells[#cells + 1] = string.format("%d/%d ok%s", #round.receipts, #round.receipts,
            round.verified and ", verified" or "") .. (round.outcome == "ok" and "" or ("; round " ..
            failed_where(round)))
        else
          cells[#cells + 1] = failed_where(round)
        end
        lines[#lines + 1] = row(cells, widths)
        overlaps = overlaps or round.overlaps
      end
    end
    for _, overlap in ipairs(overlaps or {}) do
      lines[#lines + 1] = string.format("overlap: %s run at once within %s: %s", table.concat(overlap.phases, " and "),
        overlap.within, overlap.why)
    end
  end
  -- The whole run.
  local summary = self:summary()
  local total_names, parts = {}, {}
  for name in pairs(summary.totals) do
    total_names[#total_names + 1] = name
  end
  table.sort(total_names, function(a, b)
    return summary.totals[a] > summary.totals[b]
  end)
  for _, name in ipairs(total_names) do
    parts[#parts + 1] = string.format("%s %.3f s", name, summary.totals[name])
  end
  lines[#lines + 1] = string.format("time: %.2f s in all, %.1f%% of it in the steps below", summary.seconds,
    summary.seconds > 0 and 100 * summary.accounted_seconds / summary.seconds or 100)
  if self.opening then
    lines[#lines + 1] = string.format("  opening %.2f s: %s", self.opening.seconds or 0, list_steps(self.opening.steps))
  end
  lines[#lines + 1] = string.format("  %d round%s %.2f s%s%s", self.count, self.count == 1 and "" or "s",
    self.total_seconds, #parts > 0 and ": " or "", table.concat(parts, ", "))
  if self.closing then
    lines[#lines + 1] = string.format("  closing %.2f s: %s", (self.closing.seconds or now() - self.closing.started),
      list_steps(self.closing.steps))
  end
  return lines
end

return M
