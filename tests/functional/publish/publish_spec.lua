-- `wsync run` of a recipe with a model: synthetic trainer ranks publish into
-- the reference runtime. The demo end to end; a runtime respawned after a
-- failed publication; and a wrong value that only the resident check can see.
local fixtures = require("tests.helpers.fixtures")
local leftovers = require("tests.helpers.leftovers")

local lines = leftovers.lines

-- "trainer rank R: published model version N (publication ID)" lines:
-- {[rank] = {[version] = id}}.
local function trainer_results(stdout)
  local results = {}
  for rank, version, id in stdout:gmatch("trainer rank (%d+): published model version (%d+) %(publication (%x+)%)") do
    rank, version = tonumber(rank), tonumber(version)
    results[rank] = results[rank] or {}
    assert.is_nil(results[rank][version], "rank " .. rank .. " printed version " .. version .. " twice")
    results[rank][version] = id
  end
  return results
end

-- The host's "published model version N (step S)" lines: {[version] = step}.
local function host_publications(stdout)
  local published = {}
  for version, step in stdout:gmatch("\nwsync: published model version (%d+) %(step (%d+)%)") do
    published[tonumber(version)] = tonumber(step)
  end
  return published
end

local function verdict(stdout)
  return stdout:match("\nwsync: verdict: ([^\n]*)\n")
end

describe("wsync run recipes/demo.lua", function()
  local result

  setup(function()
    result = leftovers.run({ "run", "recipes/demo.lua" })
  end)

  it("exits 0 with verdict OK and nothing on stderr", function()
    assert.are.equal(0, result.code, result.stderr)
    assert.are.equal("", result.stderr)
    assert.are.equal("OK: 3 model versions published, every resident TP slice verified", verdict(result.stdout))
  end)

  it("publishes versions 1, 2 and 3, each verified, with per-phase times and GB/s", function()
    assert.are.same({ 1, 2, 3 }, host_publications(result.stdout))
    local count = 0
    for line in result.stdout:gmatch("wsync: published model version [^\n]*") do
      count = count + 1
      assert.matches("^wsync: published model version %d %(step %d%): 395%.75 KiB in 3 chunks, [%d.]+ ms "
        .. "%(fill [%d.]+, load [%d.]+, finish [%d.]+%), [%d.]+ GB/s; receipts 2/2; resident weights verified "
        .. "%(42 tensors on 2 workers%)$", line)
    end
    assert.are.equal(3, count)
  end)

  it("gives both trainer ranks the same publication id per version, a new one each time", function()
    local results = trainer_results(result.stdout)
    assert.are.equal(3, #results[0])
    assert.are.same(results[0], results[1])
    assert.are_not.equal(results[0][1], results[0][2])
    assert.are_not.equal(results[0][2], results[0][3])
    for _, id in ipairs(results[0]) do
      assert.are.equal(32, #id) -- 128 random bits
    end
  end)

  it("closes with a report of every round: each step and each publication phase timed, GB/s and receipts",
    function()
      local out = result.stdout
      assert.matches("\nwsync: closing report: recipe demo, qwen3_moe, 2 trainer ranks %-> TP2 reference runtime\n",
        out)
      -- Every step of each round, in schedule order after the waits for the
      -- ranks, the resident check after the publication.
      assert.matches("\nwsync:   round +version +step +total ms +train_step +publish_wait +offload_optimizer +wake "
        .. "weights +publish +resident_check +offload_actor +wake kv_cache +sleep 2 +onload_actor +onload_optimizer "
        .. "+outcome\n", out)
      for round = 1, 3 do
        assert.matches("\nwsync:   " .. round .. " +" .. round .. " +" .. round .. string.rep(" +[%d.]+", 12)
          .. " +ok\n", out)
      end
      -- Every phase of each publication.
      assert.matches("\nwsync:   version +step +bytes +total ms +preflight +init +start +chunks +fill +load +verify "
        .. "+finish +release +GB/s +receipts\n", out)
      for version = 1, 3 do
        assert.matches("\nwsync:   " .. version .. " +" .. version .. " +405248" .. string.rep(" +[%d.]+", 11)
          .. " +2/2 ok, verified\n", out)
      end
      assert.matches("\nwsync:   overlap: fill and load run at once within chunks: chunk k%+1 fills while chunk k "
        .. "loads\n", out)
      -- Where the run's seconds went.
      assert.matches("\nwsync:   time: [%d.]+ s in all, [%d.]+%% of it in the steps below\n", out)
      assert.matches("\nwsync:     opening [%d.]+ s: plan [%d.]+ s, listen [%d.]+ s, registration [%d.]+ s, runtime "
        .. "start [%d.]+ s, sleep 1 [%d.]+ s\n", out)
      assert.matches("\nwsync:     3 rounds [%d.]+ s: ", out)
      assert.matches("\nwsync:   synthetic trainer processes: rank 0 exited with code 0, rank 1 exited with code 0\n",
        out)
      local ids = trainer_results(out)[0]
      assert.matches("\nwsync:   last receipt %(TP rank 0%): publication " .. ids[3] .. ", version 3, device "
        .. "[%x-]+, 21 resident tensors, manifest %x+\n", out)
    end)

  it("leaves no process, shared-memory segment or socket behind", function()
    leftovers.assert_clean(result)
    -- the host, two trainer ranks, the runtime and its two TP workers were seen
    local seen = 0
    for _ in pairs(result.pids) do
      seen = seen + 1
    end
    assert.is_true(seen >= 4, "only " .. seen .. " processes of the run were seen")
  end)
end)

describe("wsync run, the demo's variants", function()
  for _, case in ipairs({
    { recipe = "demo_tensor_storage.lua", what = "synthetic shards in one allocation per tensor (trainer.storage)",
      chunks = 3 },
    { recipe = "demo_fp8.lua", what = "FP8 residents (runtime.quantization), quantized by the loader and checked "
      .. "against the host's own quantization", chunks = 3, resident_tensors = 31 },
  }) do
    it(case.what .. ": three versions, every resident slice verified, nothing left behind", function()
      local result = leftovers.run({ "run", "tests/fixtures/recipes/" .. case.recipe })
      leftovers.assert_clean(result)
      assert.are.equal(0, result.code, result.stdout .. result.stderr)
      assert.are.equal("OK: 3 model versions published, every resident TP slice verified", verdict(result.stdout))
      assert.are.same({ 1, 2, 3 }, host_publications(result.stdout))
      assert.matches("in " .. case.chunks .. " chunks (buffers 2 x 160.00 KiB)", result.stdout, 1, true)
      assert.matches(", " .. (case.resident_tensors or 21) .. " resident tensors, manifest", result.stdout, 1, true)
    end)
  end
end)

describe("wsync run, a runtime respawned after a failed publication", function()
  it("publishes step 3 as model version 3 into a new runtime when step 2 failed as version 2", function()
    -- The runtime's 4th load_chunk is the first chunk of step 2; the new
    -- runtime counts its own requests and never reaches a 4th.
    local result = leftovers.run({ "run", fixtures.recipes .. "/publish_respawn.lua" },
      { env = { "WSYNC_RUNTIME_FAULT=crash@load_chunk#4" } })
    leftovers.assert_clean(result)
    -- A failed publication is a failed run, also when the next one succeeds.
    assert.are.equal(1, result.code)
    local failure = verdict(result.stdout):match("^FAILED: (.*)$")
    assert.matches("^%[phase chunks%] publication of model version 2 failed in chunks: ", failure)
    assert.matches("reference runtime broken during load_chunk", failure, 1, true)
    assert.matches("\nwsync: respawning the runtime after the failed publication\n", result.stdout)
    -- version 1 = step 1, version 3 = step 3: step 2's header took version 2
    -- and never committed; a version number is never given out twice.
    assert.are.same({ [1] = 1, [3] = 3 }, host_publications(result.stdout))
    local results = trainer_results(result.stdout)
    assert.are.same(results[0], results[1])
    local versions = {}
    for version in pairs(results[0]) do
      versions[#versions + 1] = version
    end
    table.sort(versions)
    assert.are.same({ 1, 3 }, versions)
    -- The host printed the failure as it happened (the session went on) and
    -- in its verdict; both ranks, which it started, said that step 2 was not
    -- published, without repeating it; nothing else is on stderr.
    assert.matches("\nwsync: round 2 %(model version 2%) failed; the runtime is respawned for the next round: "
      .. failure:gsub("%p", "%%%0") .. "\n", result.stdout)
    local skipped = {}
    for _, line in ipairs(lines(result.stderr)) do
      local prefix, rank = line:match("^%[trainer (%d)%] wsync: trainer rank (%d): step 2 not published %(the host "
        .. "respawns the runtime%)$")
      assert.are.equal(prefix, rank, line)
      skipped[#skipped + 1] = rank
    end
    table.sort(skipped)
    assert.are.same({ "0", "1" }, skipped, result.stderr)
    assert.are.equal(2, #lines(result.stderr), result.stderr)
    -- The failed round is in the closing report, between the two that
    -- committed.
    assert.matches("\nwsync:   2 +2 +%- +[%d.]+" .. string.rep(" +[%d.-]+", 9) .. " +%- +FAILED in chunks\n",
      result.stdout)
  end)
end)

describe("wsync run, a wrong value that only the resident check sees", function()
  -- Trainer rank 1 skips its optimizer step before the second publish: step
  -- 2 then carries step 1's values in rank 1's shards. Names, shapes, the
  -- manifest and the receipts are all right; the host's resident check after
  -- finish (recipe `verify`) recomputes every TP slice from step 2's values
  -- and fails the run. The runtime that committed the wrong version is then
  -- destroyed, so it never serves it, and no rank is told it was published.
  it("fails with VERIFY_RESIDENT naming a TP worker and a tensor", function()
    local result = leftovers.run({ "run", "recipes/demo.lua" },
      { env = { "WSYNC_TRAINER_FAULT=rank1:stale@publish#2" } })
    leftovers.assert_clean(result)
    assert.are.equal(1, result.code)
    local failure = verdict(result.stdout):match("^FAILED: (.*)$")
    local rank, tensor = failure:match("^%[phase resident check, rank (%d)%] TP worker (%d) holds ")
    assert.is_not_nil(rank, failure)
    assert.are.equal(rank, tensor)
    assert.matches("holds [%w_.]+ with SHA%-256 %x+; step 2's values give %x+$", failure)
    assert.are.same({ [1] = 1 }, host_publications(result.stdout))
    local results = trainer_results(result.stdout)
    assert.are.same({ [1] = results[0][1] }, results[0])
    assert.are.same(results[0], results[1])
    -- The error is printed once, in the verdict: not again by the host or
    -- by the ranks it started, which exit non-zero.
    assert.are.equal("", result.stderr)
    assert.matches("\nwsync:   synthetic trainer processes: rank 0 exited with code 1, rank 1 exited with code 1\n",
      result.stdout)
    -- Version 2 committed before its check failed: its row says both.
    assert.matches("\nwsync:   2 +2 +405248" .. string.rep(" +[%d.]+", 11) .. " +2/2 ok; round FAILED in "
      .. "resident check, rank %d\n", result.stdout)
  end)
end)

describe("wsync run stopped by a signal", function()
  -- The first publication hangs in its second load for 2 s (the fixture's
  -- timeout), so the signal lands while a publication is in flight.
  for _, case in ipairs({ { name = "sigterm", code = 143 }, { name = "sigint", code = 130 } }) do
    it(case.name .. " in the middle of a publication: exit " .. case.code .. ", nothing left behind", function()
      local result = leftovers.run({ "run", fixtures.recipes .. "/publish_faults.lua" }, {
        env = { "WSYNC_RUNTIME_FAULT=hang@load_chunk#2" },
        signal = { after = "bootstrap done", name = case.name },
      })
      leftovers.assert_clean(result)
      assert.are.equal(case.code, result.code, result.stderr)
      assert.matches("\nwsync: " .. case.name:upper() .. ": stopping now", result.stdout)
      assert.is_nil(result.stdout:find("published model version", 1, true))
      -- It did not wait for the hung command's 2 s timeout (that failure
      -- would be reported).
      assert.is_nil(result.stdout:find("\nwsync: round 1 %(model version 1%) failed"), result.stdout)
    end)
  end

  it("sigint while it waits for external trainer ranks: exit 130, the endpoint removed", function()
    local result = leftovers.run({ "run", fixtures.recipes .. "/external_tiny.lua" }, {
      signal = { after = "waiting for 2 external trainer ranks", name = "sigint" },
    })
    leftovers.assert_clean(result) -- includes the endpoint's directory under the run's TMPDIR
    assert.are.equal(130, result.code, result.stderr)
  end)
end)
