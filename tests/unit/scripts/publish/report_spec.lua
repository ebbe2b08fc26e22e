-- wsync.publish.report: a session's steps timed into rounds, the rounds kept
-- and added up, the run report's JSON (every key there, sorted, written as
-- the run goes) and the closing report's text, FAILED rounds included.
local cjson = require("cjson")
local uv = require("luv")
local report_module = require("wsync.publish.report")
local util = require("wsync.util")

-- What a committed publication's report says (wsync.publish.publication).
local function publication(version, total)
  return { model_version = version, publication_id = string.rep("ab", 16), manifest = string.rep("c", 64),
    bytes = 405248, chunks = 3, gbps = 0.1, committed = true,
    timings = { preflight = 0.001, init = 0.002, start = 0.001, chunks = 0.004, fill = 0.003, load = 0.003,
      verify = 0.001, finish = 0.001, release = 0, total = total, fill_copy = 0.001, load_copy = 0.001 },
    receipts = { { tp_rank = 0, model_version = version } },
    overlaps = { { phases = { "fill", "load" }, within = "chunks", why = "chunk k+1 fills while chunk k loads" } } }
end

local ABOUT = {
  recipe = { name = "demo", path = "recipes/demo.lua", backend = "host", model = {}, verify = true,
    trainer = { kind = "synthetic", steps = 3 }, runtime = { kind = "reference" }, buffers = {} },
  plan = { family = "qwen3_moe", canonical = { 1, 2 }, bytes = 405248, chunks = { 1, 2, 3 }, manifest = "m",
    buffer_count = 2, buffer_bytes = 163840 },
  topology = { world = 2, tp = 2 },
}

-- A report with one round that committed and one that failed in a step
-- after its waits.
local function two_rounds(report)
  local round = report:begin_round(1, { train_step = 0.5, publish_wait = 0.25 })
  round.step = 1
  report_module.timed(round, "offload_optimizer", "trainer", function() end, { where = "schedule[1]" })
  report:add_publication(round, publication(1, 0.01), "ok", "schedule[2]")
  report:end_round(round)
  round = report:begin_round(2, { train_step = 0.5, publish_wait = 0.25 })
  round.step = 2
  local ok = pcall(report_module.timed, round, "offload_optimizer", "trainer", function()
    require("wsync.errors").raise("CALLBACK_FAILED", "callback 'offload_optimizer' failed", { rank = 1,
      phase = "callback" })
  end, { where = "schedule[1]" })
  assert.is_false(ok)
  report:end_round(round, require("wsync.errors").new("CALLBACK_FAILED", "callback 'offload_optimizer' failed",
    { rank = 1, phase = "callback" }))
  return report
end

describe("wsync.publish.report", function()
  it("times a step, also one that raises, and passes on what it returned or raised", function()
    local target = { steps = {} }
    local a, b = report_module.timed(target, "wake weights", "wake", function()
      uv.sleep(5)
      return 1, 2
    end, { where = "schedule[2]" })
    assert.are.same({ 1, 2 }, { a, b })
    local ok, err = pcall(report_module.timed, target, "sleep 2", "sleep", function()
      error("engine gone", 0)
    end)
    assert.is_false(ok)
    assert.are.equal("engine gone", err)
    assert.are.equal(2, #target.steps)
    assert.are.same({ "wake weights", "wake", "schedule[2]", "ok" }, { target.steps[1].name, target.steps[1].kind,
      target.steps[1].where, target.steps[1].outcome })
    assert.is_true(target.steps[1].seconds >= 0.005)
    assert.are.equal("failed", target.steps[2].outcome)
  end)

  it("keeps the newest rounds, counts them all and adds every step up by name", function()
    local report = report_module.new(ABOUT)
    for number = 1, report_module.KEPT_ROUNDS + 3 do
      local round = report:begin_round(number, { train_step = 1 })
      report:add_publication(round, publication(number, 0.5), "ok")
      report:end_round(round)
    end
    assert.are.equal(report_module.KEPT_ROUNDS, #report.rounds)
    assert.are.equal(4, report.rounds[1].round)
    assert.are.equal(report_module.KEPT_ROUNDS + 3, report.count)
    assert.are.equal(report_module.KEPT_ROUNDS + 3, report.published)
    assert.are.equal(report_module.KEPT_ROUNDS + 3, report.totals.train_step)
    assert.are.equal((report_module.KEPT_ROUNDS + 3) * 0.5, report.totals.publish)
  end)

  it("gives a round every key, null where it does not apply, a failed one with its error", function()
    local report = two_rounds(report_module.new(ABOUT))
    local ok_round, failed = report_module.round_json(report.rounds[1]), report_module.round_json(report.rounds[2])
    local keys = {}
    for key in pairs(ok_round) do
      keys[#keys + 1] = key
    end
    table.sort(keys)
    assert.are.same({ "bytes", "chunks", "committed", "error", "gbps", "manifest", "model_version", "outcome",
      "overlaps", "publication_id", "receipts", "round", "seconds", "step", "steps", "timings", "verified" }, keys)
    assert.are.same({ "train_step", "publish_wait", "offload_optimizer", "publish" }, {
      ok_round.steps[1].name, ok_round.steps[2].name, ok_round.steps[3].name, ok_round.steps[4].name })
    -- (started: the monotonic clock's seconds, as uv.hrtime reads it)
    assert.is_true(math.abs(ok_round.steps[4].started - (uv.hrtime() / 1e9 - 0.01)) < 60)
    assert.are.same({ name = "publish", kind = "publish", where = "schedule[2]", started = ok_round.steps[4].started,
      seconds = 0.01, bytes = 405248, device_memory = util.json_null, predicted_bytes = util.json_null, outcome = "ok",
      parts = util.json_null }, ok_round.steps[4])
    assert.are.equal(util.json_null, ok_round.error)
    assert.are.equal("failed", failed.outcome)
    assert.are.same({ code = "CALLBACK_FAILED", message = "callback 'offload_optimizer' failed", rank = 1,
      phase = "callback" }, failed.error)
    assert.are.equal(util.json_null, failed.model_version)
    assert.is_false(failed.committed)
    assert.are.equal(util.json_null, failed.timings.total)
    assert.are.equal("failed", failed.steps[3].outcome)
    -- (The text of the JSON has an empty list as [] and sorted keys.)
    assert.matches('"receipts":[],', util.json(failed), 1, true)
  end)

  it("writes the run report as the run goes: sorted keys, every round, the failed one included", function()
    local path = os.tmpname()
    local file = assert(io.open(path, "w"))
    local report = report_module.new(ABOUT)
    report:write_to(file)
    report_module.add_step(report.opening, { name = "registration", kind = "wait", seconds = 0.1 })
    report:end_opening()
    two_rounds(report)
    local closing = report:begin_closing()
    report_module.add_step(closing, { name = "runtime shutdown", kind = "close", seconds = 0.01 })
    report:end_closing()
    report:finish(require("wsync.errors").new("CALLBACK_FAILED", "callback 'offload_optimizer' failed"))
    assert.are.equal("closed file", io.type(file))
    local text = assert(util.read_file(path))
    os.remove(path)
    local decoded = cjson.decode(text)
    -- One line per round; otherwise the text is util.json's, keys sorted
    -- (lua-cjson reads an empty list back as {}).
    assert.are.equal(util.json(decoded) .. "\n", (text:gsub("\n(.)", "%1"):gsub("%[%]", "{}")))
    assert.are.equal(2, #decoded.rounds)
    assert.are.same({ "ok", "failed" }, { decoded.rounds[1].outcome, decoded.rounds[2].outcome })
    assert.are.equal("wsync-run-report", decoded.schema)
    assert.are.equal(1, decoded.schema_version)
    assert.are.equal(require("wsync").build.version, decoded.wsync.version)
    assert.are.same({ name = "demo", path = "recipes/demo.lua", backend = "host", verify = true,
      trainer = { kind = "synthetic", ranks = 2, steps = 3 }, runtime = { kind = "reference", tp = 2, replicas = 1 } },
      decoded.recipe)
    assert.are.same({ count = 2, bytes = 163840 }, decoded.plan.buffers)
    local run = decoded.run
    assert.are.equal("failed", run.outcome)
    assert.are.equal("CALLBACK_FAILED", run.error.code)
    assert.are.same({ 2, 1 }, { run.rounds, run.published })
    assert.are.equal(1.0, run.totals.train_step)
    assert.are.equal("runtime shutdown", run.closing.steps[1].name)
    assert.is_true(run.accounted_seconds >= 0.1 + 2 * 0.75)
    assert.are.equal("registration", decoded.opening.steps[1].name)
  end)

  it("writes a report of a run that never opened a session", function()
    local path = os.tmpname()
    report_module.write_unopened(assert(io.open(path, "w")), { path = "bad.lua" },
      require("wsync.errors").new("RECIPE_INVALID", "syntax error", { file = "bad.lua", line = 3 }))
    local text = assert(util.read_file(path))
    os.remove(path)
    local decoded = cjson.decode(text)
    assert.are.same({}, decoded.rounds)
    assert.are.equal(cjson.null, decoded.opening)
    assert.are.equal(cjson.null, decoded.plan)
    assert.are.equal("bad.lua", decoded.recipe.path)
    assert.are.same({ code = "RECIPE_INVALID", message = "syntax error", file = "bad.lua", line = 3 },
      decoded.run.error)
  end)

  it("prints each round's steps and each publication's phases, a FAILED round's where it failed", function()
    local lines = two_rounds(report_module.new(ABOUT)):text_lines()
    local text = table.concat(lines, "\n") .. "\n"
    assert.matches("\nround +version +step +total ms +train_step +publish_wait +offload_optimizer +publish +outcome\n",
      text)
    assert.matches("\n1 +1 +1 +[%d.]+ +500%.0 +250%.0 +[%d.]+ +10%.0 +ok\n", text)
    assert.matches("\n2 +%- +2 +[%d.]+ +500%.0 +250%.0 +[%d.]+! +%- +FAILED in callback, rank 1\n", text)
    assert.matches("\nversion +step +bytes +total ms +preflight +init +start +chunks +fill +load +verify +finish "
      .. "+release +GB/s +receipts\n1 +1 +405248 +10%.0 +1%.0 +2%.0", text)
    assert.matches("\noverlap: fill and load run at once within chunks: chunk k%+1 fills while chunk k loads\n", text)
    assert.matches("\n  2 rounds [%d.]+ s: train_step 1%.000 s, publish_wait 0%.500 s", text)
  end)

  it("prints and writes the memory in use on each device after each step, where it was sampled", function()
    local GIB = 1024 ^ 3
    local report = report_module.new(ABOUT)
    local round = report:begin_round(1, { train_step = 0.5, publish_wait = 0.25 })
    report_module.timed(round, "offload_optimizer", "trainer", function() end, { where = "schedule[1]" })
    round.steps[#round.steps].device_memory = {
      { device = "gpu-a", used_bytes = 10 * GIB, total_bytes = 80 * GIB, processes = {
        { pid = 7, role = "wsync host, trainer rank 0", used_bytes = 4 * GIB }, { pid = 9, role = "TP worker 0" } } },
      { device = "gpu-b", used_bytes = 2.5 * GIB, total_bytes = 80 * GIB } }
    report:add_publication(round, publication(1, 0.01), "ok", "schedule[2]")
    round.steps[#round.steps].device_memory = { { device = "gpu-a", used_bytes = 11 * GIB, total_bytes = 80 * GIB,
      processes = {} }, { device = "gpu-b", used_bytes = 3 * GIB, total_bytes = 80 * GIB } }
    report:end_round(round)
    local text = table.concat(report:text_lines(), "\n") .. "\n"
    assert.matches("\ndevice memory in use after each step %(GiB; devices, in this order: gpu%-a, gpu%-b%):\n"
      .. "round +version +train_step +publish_wait +offload_optimizer +publish\n"
      .. "1 +1 +%- +%- +10%.00/2%.50 +11%.00/3%.00\n",
      text)
    assert.matches("\nwhat holds it after each step of round 1 %(GiB, by process%):\n"
      .. "  offload_optimizer, gpu%-a: 10%.00 GiB %(wsync host, trainer rank 0 4%.00, TP worker 0%)\n"
      .. "  offload_optimizer, gpu%-b: 2%.50 GiB\n  publish, gpu%-a: 11%.00 GiB\n  publish, gpu%-b: 3%.00 GiB\n", text)
    local steps = cjson.decode(util.json(report_module.round_json(round))).steps
    assert.are.equal(cjson.null, steps[1].device_memory) -- (train_step: a wait, not sampled)
    assert.are.same({ { device = "gpu-a", used_bytes = 10 * GIB, total_bytes = 80 * GIB, processes = {
      { pid = 7, role = "wsync host, trainer rank 0", used_bytes = 4 * GIB },
      { pid = 9, role = "TP worker 0", used_bytes = cjson.null } } },
      { device = "gpu-b", used_bytes = 2.5 * GIB, total_bytes = 80 * GIB, processes = cjson.null } },
      steps[3].device_memory)
    assert.are.equal("[]", util.json(report_module.round_json(round).steps[4].device_memory[1].processes))
  end)

  it("sets the model's prediction beside what each step measured, and names the worst step against its promise",
    function()
      local GIB = 1024 ^ 3
      local report = report_module.new(ABOUT)
      local round = report:begin_round(1, {})
      local function step(name, measured, predicted)
        report_module.timed(round, name, "trainer", function() end, { where = "schedule[1]" })
        round.steps[#round.steps].device_memory = { { device = "gpu-a", used_bytes = 1 * GIB, total_bytes = 80 * GIB },
          { device = "gpu-b", used_bytes = measured, total_bytes = 80 * GIB } }
        round.steps[#round.steps].predicted_bytes = predicted
      end
      step("offload_optimizer", 30.5 * GIB, 30 * GIB) -- (0.5 GiB off: within 1 GiB)
      step("wake kv_cache", 44 * GIB, 40 * GIB) -- (10 %: outside 5 % of 40 GiB, 2 GiB)
      step("onload_optimizer", 2.5 * GIB, 2 * GIB)
      report:end_round(round)
      local kv = round.steps[#round.steps - 1]
      assert.are.same({ measured = 44 * GIB, predicted = 40 * GIB, percent = 10, ratio = 2 },
        report_module.memory_error(kv))
      local text = table.concat(report:text_lines(), "\n") .. "\n"
      assert.matches("\nthe memory model against the device after each step of round 1 %(GiB, the most loaded "
        .. "device%):\n  offload_optimizer +predicted +30%.00, measured +30%.50 %(%+1%.7 %%%)\n", text)
      assert.matches("\nschedule memory: worst step wake kv_cache %(round 1%): predicted 40%.00 GiB, measured 44%.00 "
        .. "GiB %(%+10%.0 %%%), outside 5%% or 1 GiB\n", text)
      local steps = cjson.decode(util.json(report_module.round_json(round))).steps
      assert.are.equal(40 * GIB, steps[#steps - 1].predicted_bytes)
    end)
end)
