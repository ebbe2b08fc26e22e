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

  it("closes with a report of every version: phase times, GB/s and receipts", function()
    local out = result.stdout
    assert.matches("\nwsync: closing report: recipe demo, qwen3_moe, 2 trainer ranks %-> TP2 reference runtime\n", out)
    assert.matches("\nwsync:   version +step +bytes +total ms +init ms +fill ms +load ms +finish ms +GB/s +receipts\n",
      out)
    for version = 1, 3 do
      assert.matches("\nwsync:   " .. version .. " +" .. version .. " +405248 +[%d.]+ +[%d.]+ +[%d.]+ +[%d.]+ +[%d.]+ "
        .. "+[%d.]+ +2/2 ok, verified\n", out)
    end
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
  }) do
    it(case.what .. ": three versions, every resident slice verified, nothing left behind", function()
      local result = leftovers.run({ "run", "tests/fixtures/recipes/" .. case.recipe })
      leftovers.assert_clean(result)
      assert.are.equal(0, result.code, result.stdout .. result.stderr)
      assert.are.equal("OK: 3 model versions published, every resident TP slice verified", verdict(result.stdout))
      assert.are.same({ 1, 2, 3 }, host_publications(result.stdout))
      assert.matches("in " .. case.chunks .. " chunks (buffers 2 x 160.00 KiB)", result.stdout, 1, true)
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
    -- both ranks said that step 2 was not published, with the host's error
    local skipped = 0
    for _, line in ipairs(lines(result.stderr)) do
      local prefix, rank, message = line:match("^%[trainer (%d)%] wsync: trainer rank (%d): step 2 not published %(the "
        .. "host respawns the runtime%): (.*)$")
      if rank then
        assert.are.equal(prefix, rank)
        skipped = skipped + 1
        assert.are.equal(failure, message)
      end
    end
    assert.are.equal(2, skipped, result.stderr)
    -- and the host's own error line; nothing else
    local host = 0
    for _, line in ipairs(lines(result.stderr)) do
      host = host + (line == "wsync: " .. failure and 1 or 0)
    end
    assert.are.equal(1, host, result.stderr)
    assert.are.equal(3, #lines(result.stderr), result.stderr)
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
    -- both ranks (through the host, prefixed) and the host print the same error
    local same = 0
    for _, line in ipairs(lines(result.stderr)) do
      assert.are.equal("wsync: " .. failure, (line:gsub("^%[trainer %d%] ", "")))
      same = same + 1
    end
    assert.are.equal(3, same)
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
      assert.is_nil(result.stdout:find("publication failed", 1, true), result.stdout)
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
