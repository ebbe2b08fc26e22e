-- wsync.publish.run, with a fake session module: the rounds until the
-- session says stop, everything closed, then the closing report and the
-- verdict once (OK; the session's failure; a trainer process's failure; an
-- opening that failed), and the signal handlers it installs and removes.
local uv = require("luv")
local errors = require("wsync.errors")
local run_module = require("wsync.publish.run")
local captured = require("tests.helpers.stdout").captured

-- A session module whose session publishes `rounds` rounds, then stops
-- (`in_round()` runs in each round); `open_error`: what open raises
-- after on_open (`before_open`: before it); `trainer_failure`: what the
-- trainer processes say failed the run. `events` lists what was called.
local function sessions_of(options)
  options = options or {}
  local events = {}
  local session = {
    recipe = { name = "demo", runtime = { kind = "reference" }, buffers = {}, verify = options.verify },
    plan = { family = "qwen3_moe", canonical = { 1 }, bytes = 1024, chunks = { 1 }, manifest = "m", buffer_count = 2,
      buffer_bytes = 512 },
    topology = { world = 2, tp = 2 }, timeouts = { shutdown = 5 }, reports = { "the rounds" }, rounds = 0,
  }
  session.report = {
    published = options.rounds or 0,
    text_lines = function()
      return { "time: 1.00 s in all" }
    end,
    finish = function(_, err)
      events[#events + 1] = "report finish " .. tostring(err and err.code or err)
    end,
    write_to = function(_, file)
      events[#events + 1] = "report to " .. file
    end,
  }
  session.trainers = {
    ends = function()
      return "rank 0 exited with code 0"
    end,
    failure = function(_, shutdown)
      events[#events + 1] = "trainer failure " .. shutdown
      return options.trainer_failure
    end,
  }
  function session.wait_publish(self)
    events[#events + 1] = "wait_publish"
    return self.rounds < (options.rounds or 0)
  end
  function session.round(self)
    events[#events + 1] = "round"
    self.rounds = self.rounds + 1
    if options.in_round then
      options.in_round()
    end
  end
  function session.finish()
    events[#events + 1] = "finish"
  end
  function session.fail(self, err)
    self.failure = self.failure or err
  end
  local sessions = {
    open = function(_, open_options)
      if options.before_open then
        error(options.before_open, 0)
      end
      open_options.on_open(session)
      if options.open_error then
        session.failure = options.open_error
        error(options.open_error, 0)
      end
      return session
    end,
    close = function(closed)
      assert(closed == session)
      events[#events + 1] = "close"
    end,
    abort = function()
      events[#events + 1] = "abort"
    end,
  }
  return sessions, events, session
end

-- Runs the recipe with `sessions`; returns what it printed and its outcome.
local function run(sessions, options)
  local outcome = {}
  local said = captured(function()
    outcome.ok, outcome.result = pcall(run_module.run, sessions, {}, options)
  end)
  return said, outcome
end

local CLOSING = "wsync: closing report: recipe demo, qwen3_moe, 2 trainer ranks -> TP2 reference runtime\n"
  .. "wsync:   plan: 1 canonical tensors, 1.00 KiB, 1 chunks (buffers 2 x 512 B), manifest m\n"
  .. "wsync:   time: 1.00 s in all\n"
  .. "wsync:   synthetic trainer processes: rank 0 exited with code 0\n"

describe("wsync.publish.run", function()
  it("runs rounds until the session stops, closes it, and ends with the closing report and verdict OK", function()
    local sessions, events = sessions_of({ rounds = 2, verify = "values" })
    local said, outcome = run(sessions)
    assert.is_true(outcome.ok)
    assert.are.same({ "the rounds" }, outcome.result)
    assert.are.same({ "wait_publish", "round", "wait_publish", "round", "wait_publish", "finish", "close",
      "trainer failure 5", "report finish nil" }, events)
    assert.are.equal(CLOSING .. "wsync: verdict: OK: 2 model versions published, every resident TP slice verified "
      .. "against the trainer's values\n", said)
    sessions = sessions_of({ rounds = 1 })
    said = run(sessions)
    assert.matches("\nwsync: verdict: OK: 1 model versions published\n$", said)
  end)

  it("raises the session's failure after everything closed, its verdict said once", function()
    local sessions, events, session = sessions_of({ rounds = 3 })
    session.round = function()
      error("a bug", 0)
    end
    local said, outcome = run(sessions)
    assert.is_false(outcome.ok)
    assert.are.equal("LUA_ERROR", outcome.result.code)
    assert.are.equal("a bug", outcome.result.message)
    assert.is_true(errors.was_reported(outcome.result))
    assert.are.same({ "wait_publish", "close", "report finish LUA_ERROR" }, events)
    assert.matches("\nwsync: verdict: FAILED: .*a bug\n$", said)
    assert.are.equal(1, select(2, said:gsub("verdict:", "")))
  end)

  it("fails a run that nothing else failed when a trainer process failed, and only then", function()
    local trainer_failure = errors.new("TRAINER_FAILED", "synthetic trainer rank 1 exited with code 3")
    local sessions, events = sessions_of({ trainer_failure = trainer_failure })
    local said, outcome = run(sessions)
    assert.are.equal(trainer_failure, outcome.result)
    assert.are.equal("report finish TRAINER_FAILED", events[#events])
    assert.matches("\nwsync: verdict: FAILED: .*synthetic trainer rank 1 exited with code 3\n$", said)
    local session
    sessions, events, session = sessions_of({ trainer_failure = trainer_failure })
    session.finish = function(self)
      self.failure = errors.new("PUBLISH_TIMEOUT", "no trainer rank called publish")
    end
    local _, first = run(sessions)
    assert.are.equal("PUBLISH_TIMEOUT", first.result.code)
    for _, event in ipairs(events) do
      assert.are_not.equal("trainer failure 5", event, "asked the trainers after a failure")
    end
  end)

  it("says the closing report and the verdict of an opening that failed", function()
    local failure = errors.new("STARTUP", "1 of 2 trainer ranks registered within 3 s")
    local sessions, events = sessions_of({ open_error = failure })
    local said, outcome = run(sessions, { report_file = "report.json" })
    assert.are.equal(failure, outcome.result)
    assert.is_true(errors.was_reported(failure))
    assert.are.same({ "report to report.json", "report finish STARTUP" }, events)
    assert.are.equal(CLOSING .. "wsync: verdict: FAILED: " .. tostring(failure) .. "\n", said)
    -- (Before the session existed: the verdict alone.)
    sessions = sessions_of({ before_open = failure })
    said = run(sessions)
    assert.are.equal("wsync: verdict: FAILED: " .. tostring(failure) .. "\n", said)
  end)

  it("handles SIGINT and SIGTERM while it runs, unless told not to, and leaves no handler", function()
    local function signal_handles()
      local count = 0
      uv.walk(function(handle)
        if handle:get_type() == "signal" and not handle:is_closing() then
          count = count + 1
        end
      end)
      return count
    end
    local before = signal_handles()
    for _, case in ipairs({ { options = nil, during = 2 }, { options = { signals = false }, during = 0 } }) do
      local during
      local sessions = sessions_of({ rounds = 1, in_round = function()
        during = signal_handles()
      end })
      local _, outcome = run(sessions, case.options)
      assert(outcome.ok, outcome.result)
      assert.are.equal(before + case.during, during)
      uv.run("nowait") -- (the closed handles' callbacks)
      assert.are.equal(before, signal_handles())
    end
  end)
end)
