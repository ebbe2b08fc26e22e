-- The run report, `wsync run RECIPE --report FILE.json`: every round, FAILED
-- ones included, with each step timed (the waits for the ranks, the
-- schedule's steps, the publication and its phases, the resident check),
-- the opening and the closing; sorted keys and a schema version; written
-- also when the run fails, is interrupted, or its recipe is refused. And the
-- closing report's text says the same.
local cjson = require("cjson")
local uv = require("luv")
local fixtures = require("tests.helpers.fixtures")
local leftovers = require("tests.helpers.leftovers")
local util = require("wsync.util")

local STEPS = { "train_step", "publish_wait", "offload_optimizer", "wake weights", "publish", "resident_check",
  "offload_actor", "wake kv_cache", "sleep 2", "onload_actor", "onload_optimizer" }

-- A path for a report in a fresh directory; and a function that reads the
-- report there (its text and its decoded value) and removes both.
local function report_path()
  local directory = assert(uv.fs_mkdtemp((os.getenv("TMPDIR") or "/tmp") .. "/wsync-report-XXXXXX"))
  local path = directory .. "/run.json"
  return path, function()
    local text = util.read_file(path)
    os.remove(path)
    assert(uv.fs_rmdir(directory))
    assert(text, "no report was written")
    return text, cjson.decode(text)
  end
end

local function names(steps)
  local out = {}
  for index, step in ipairs(steps) do
    out[index] = step.name
  end
  return out
end

-- The report's text is util.json's (sorted keys at every depth), one round a
-- line.
local function assert_sorted(text, report)
  assert.are.equal(util.json(report) .. "\n", (text:gsub("\n(.)", "%1"):gsub("%[%]", "{}")))
end

describe("wsync run --report", function()
  it("the demo: every round with every step timed, the phases, the opening and closing, sorted keys", function()
    local path, read = report_path()
    local result = leftovers.run({ "run", "recipes/demo.lua", "--report", path })
    leftovers.assert_clean(result)
    local text, report = read()
    assert.are.equal(0, result.code, result.stderr)
    assert_sorted(text, report)
    assert.are.same({ "opening", "plan", "recipe", "rounds", "run", "schema", "schema_version", "wsync" },
      require("wsync.util").sorted_keys(report))
    assert.are.equal("wsync-run-report", report.schema)
    assert.are.equal(1, report.schema_version)
    assert.are.equal(require("wsync").build.version, report.wsync.version)
    assert.are.same({ "plan", "listen", "registration", "runtime start", "sleep 1" }, names(report.opening.steps))
    assert.are.equal(3, #report.rounds)
    for index, round in ipairs(report.rounds) do
      assert.are.equal(index, round.round)
      assert.are.equal(index, round.model_version)
      assert.are.equal("ok", round.outcome)
      assert.is_true(round.committed)
      assert.are.same(STEPS, names(round.steps))
      local sum = 0
      for _, step in ipairs(round.steps) do
        assert.are.equal("ok", step.outcome)
        assert.are.equal(cjson.null, step.device_memory) -- (a slot, filled by the schedule's memory later)
        assert.is_true(step.seconds >= 0)
        sum = sum + step.seconds
      end
      assert.is_true(sum <= round.seconds + 1e-6, "the steps take more than the round")
      assert.are.equal(405248, round.steps[5].bytes)
      assert.are.equal(round.timings.total, round.steps[5].seconds)
      for _, phase in ipairs({ "preflight", "init", "start", "chunks", "fill", "load", "verify", "finish",
        "release", "total", "fill_copy", "load_copy" }) do
        assert.is_number(round.timings[phase], phase)
      end
      assert.are.equal(cjson.null, round.timings.commit) -- (the reference runtime does not time its commit)
      assert.are.equal("fill", round.overlaps[1].phases[1])
      assert.are.equal(2, #round.receipts)
      assert.are.same({ tensors = 42, workers = 2 }, round.verified)
    end
    local run = report.run
    assert.are.same({ "ok", 3, 3 }, { run.outcome, run.rounds, run.published })
    assert.are.equal(cjson.null, run.error)
    assert.are.same({ "ranks leave", "runtime shutdown", "trainers exit" }, names(run.closing.steps))
    assert.is_true(run.accounted_seconds <= run.seconds and run.accounted_seconds > 0.8 * run.seconds,
      string.format("%.3f of %.3f s accounted", run.accounted_seconds, run.seconds))
    -- The closing report's rows are the file's rounds.
    for _, round in ipairs(report.rounds) do
      assert.matches(string.format("\nwsync:   %d +%d +%d +%.1f +", round.round, round.model_version, round.step,
        round.seconds * 1e3), result.stdout)
    end
  end)

  it("a run that fails: written all the same, the failed round in it with the step and phase it failed in",
    function()
      local path, read = report_path()
      -- (The runtime's 4th load_chunk is the first chunk of the second
      -- publication: round 1 commits, round 2 fails in chunks.)
      local result = leftovers.run({ "run", fixtures.recipes .. "/publish_faults.lua", "--report", path },
        { env = { "WSYNC_RUNTIME_FAULT=crash@load_chunk#4" } })
      leftovers.assert_clean(result)
      local text, report = read()
      assert.are.equal(1, result.code, result.stdout)
      assert_sorted(text, report)
      assert.are.same({ "ok", "failed" }, { report.rounds[1].outcome, report.rounds[2].outcome })
      local failed = report.rounds[2]
      assert.are.equal(2, failed.model_version)
      assert.is_false(failed.committed)
      assert.are.same({ cjson.null, cjson.null }, { failed.bytes, failed.gbps }) -- (nothing published)
      assert.are.same({ code = "PUBLISH_FAILED", phase = "chunks", cause = "RUNTIME_BROKEN",
        message = failed.error.message }, failed.error)
      assert.matches("^publication of model version 2 failed in chunks: reference runtime broken during load_chunk",
        failed.error.message)
      local publish = failed.steps[5]
      assert.are.same({ "publish", "failed", cjson.null }, { publish.name, publish.outcome, publish.bytes })
      assert.is_number(failed.timings.load)
      assert.are.equal(cjson.null, failed.timings.finish)
      assert.are.same({ "failed", 2, 1 }, { report.run.outcome, report.run.rounds, report.run.published })
      assert.are.equal("PUBLISH_FAILED", report.run.error.code)
      -- The closing report has the failed round's row too.
      assert.matches("\nwsync:   2 +2 +2 +[%d.]+" .. string.rep(" +[%d.]+", 5) .. "! +" .. string.rep("%- +", 6)
        .. "FAILED in chunks\n", result.stdout)
    end)

  it("together steps: one entry each, with the time and bytes of each of its two parts; a failure in one fails "
    .. "the round in that step", function()
    local schedule = 'schedule={ "offload_optimizer", { wake = { "weights" } }, "publish", { together = { '
      .. '"offload_actor", { wake = { "kv_cache" } } } }, { together = { { sleep = 2 }, "onload_actor" } }, '
      .. '"onload_optimizer" }'
    local path, read = report_path()
    local result = leftovers.run({ "run", "recipes/demo.lua", schedule, "--report", path })
    leftovers.assert_clean(result)
    local _, report = read()
    assert.are.equal(0, result.code, result.stderr)
    for _, round in ipairs(report.rounds) do
      assert.are.same({ "train_step", "publish_wait", "offload_optimizer", "wake weights", "publish", "resident_check",
        "offload_actor + wake kv_cache", "onload_actor + sleep 2", "onload_optimizer" }, names(round.steps))
      local together = round.steps[7]
      assert.are.same({ "together", "schedule[4]", "ok" }, { together.kind, together.where, together.outcome })
      assert.are.same({ "offload_actor", "wake kv_cache" }, names(together.parts))
      assert.are.same({ "trainer", "wake" }, { together.parts[1].kind, together.parts[2].kind })
      for _, part in ipairs(together.parts) do
        assert.is_true(part.seconds > 0 and part.seconds <= together.seconds)
      end
      assert.are.equal(cjson.null, round.steps[5].parts)
    end
    -- A rank that dies in the callback of a together step: the step failed,
    -- its parts each with their own outcome.
    local failed_path, read_failed = report_path()
    local failing = leftovers.run({ "run", "recipes/demo.lua", schedule, "--report", failed_path },
      { env = { "WSYNC_TRAINER_FAULT=rank1:die@callback#2" } })
    leftovers.assert_clean(failing)
    local _, failed_report = read_failed()
    assert.are.equal(1, failing.code)
    assert.matches("wsync: verdict: FAILED: [phase callback, rank 1] trainer rank 1: ", failing.stdout, 1, true)
    local failed = failed_report.rounds[1].steps[7]
    assert.are.same({ "offload_actor + wake kv_cache", "failed" }, { failed.name, failed.outcome })
    assert.are.same({ "failed", "ok" }, { failed.parts[1].outcome, failed.parts[2].outcome })
  end)

  it("a run stopped by SIGINT: the round in flight is in it, interrupted", function()
    local path, read = report_path()
    -- (Sent once the host says it waits for the hung load: the round is in
    -- flight.)
    local result = leftovers.run({ "run", fixtures.recipes .. "/publish_faults.lua", "--report", path }, {
      env = { "WSYNC_RUNTIME_FAULT=hang@load_chunk#2", "WSYNC_PROGRESS_AFTER=0.5" },
      signal = { after = "to answer load_chunk", name = "sigint" } })
    leftovers.assert_clean(result)
    local text, report = read()
    assert.are.equal(130, result.code, result.stderr)
    assert_sorted(text, report)
    assert.are.equal(1, #report.rounds)
    assert.are.same({ "failed", "INTERRUPTED" }, { report.rounds[1].outcome, report.rounds[1].error.code })
    assert.are.same({ "failed", "INTERRUPTED" }, { report.run.outcome, report.run.error.code })
  end)

  it("a refused recipe: the report says why, with no rounds; an unwritable report is refused first", function()
    local path, read = report_path()
    local result = leftovers.run({ "run", fixtures.recipes .. "/syntax_error.lua", "--report", path })
    local _, report = read()
    assert.are.equal(3, result.code)
    assert.are.same({}, report.rounds)
    assert.are.same({ "failed", "RECIPE_INVALID", 5 }, { report.run.outcome, report.run.error.code,
      report.run.error.line })
    local refused = leftovers.run({ "run", "recipes/demo.lua", "--report", "/nonexistent/dir/run.json" })
    assert.are.equal(2, refused.code)
    assert.are.equal("", refused.stdout)
    assert.matches("^wsync: cannot write the run report: /nonexistent/dir/run.json: No such file or directory",
      refused.stderr)
  end)

  it("--json is refused: the report is run's JSON output, and --help says so", function()
    local result = leftovers.run({ "run", "recipes/demo.lua", "--json" })
    assert.are.equal(2, result.code)
    assert.are.equal("", result.stdout)
    assert.matches("its machine-readable output is the run report: wsync run RECIPE --report FILE.json", result.stderr,
      1, true)
    local help = leftovers.run({ "--help" }).stdout
    assert.matches("wsync run RECIPE [KEY=VALUE...] [--report FILE.json]", help, 1, true)
    assert.matches("%(run has no\n +%-%-json: the report is its JSON output%)", help)
  end)
end)
