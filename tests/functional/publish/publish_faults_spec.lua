-- The fail-stop matrix of a publication, run end to end with `wsync run`:
-- the reference runtime crashes, hangs or answers garbage at every weight
-- command (each of the demo's three chunks included), a trainer rank dies or
-- fails during a fill, a rank registers a packed expert tensor short of one
-- expert, two ranks claim one device, the runtime speaks another protocol
-- version, and a recipe whose plan or schedule cannot work.
--
-- For every case: a non-zero exit; the error names the phase and the cause,
-- printed once (in the verdict: not again on stderr by the host or by the
-- synthetic ranks it started, each surviving one exiting non-zero); no
-- model version was committed (no "published model version" line from the
-- host or from a rank); and nothing is left: no process of the run, no
-- /dev/shm/wsync-* segment of one of its processes, no socket.
--
-- The recipe (tests/fixtures/recipes/publish_faults.lua) gives the runtime
-- commands 2 s and the process group 300 ms between SIGTERM and SIGKILL, so
-- a hang costs about 2 s.
local uv = require("luv")
local fixtures = require("tests.helpers.fixtures")
local faults = require("tests.helpers.faults")
local leftovers = require("tests.helpers.leftovers")

local RECIPE = fixtures.recipes .. "/publish_faults.lua"

local COMMANDS, KINDS, says_any = faults.COMMANDS, faults.KINDS, faults.says_any

local timings = {}

local function escape(text)
  return (text:gsub("%p", "%%%0"))
end

-- faults.run_failing on this spec's recipe, timed.
local function run_failing(options)
  options.recipe = options.recipe or RECIPE
  options.timings = timings
  return faults.run_failing(options)
end

describe("publication faults", function()
  local started

  setup(function()
    started = uv.hrtime()
  end)

  teardown(function()
    local lines = { string.format("\npublication faults: %d runs in %.1f s", #timings, (uv.hrtime() - started) / 1e9) }
    table.sort(timings, function(a, b)
      return a.wall > b.wall
    end)
    for index = 1, math.min(#timings, 3) do
      lines[#lines + 1] = string.format("  slowest: %-38s %.2f s", timings[index].label, timings[index].wall)
    end
    io.stderr:write(table.concat(lines, "\n"), "\n")
  end)

  describe("in the runtime", function()
    for _, kind in ipairs(KINDS) do
      for _, command in ipairs(COMMANDS) do
        local spec = kind.kind .. "@" .. command.at
        it(spec .. ": fails in " .. command.phase .. ", naming the cause", function()
          local failure = run_failing({ env = { "WSYNC_RUNTIME_FAULT=" .. spec }, survivors = 2, label = spec })
          assert.matches("^%[phase " .. command.phase, failure)
          assert.matches("reference runtime broken during " .. command.cmd .. ": ", failure, 1, true)
          assert.is_true(says_any(failure, kind.causes), "the cause is not named: " .. failure)
          if command.phase ~= "init" then
            assert.matches("publication of model version 1 failed in " .. command.phase .. ": ", failure, 1, true)
          end
        end)
      end
    end

    it("worker1:crash@load_chunk#2: the error every rank gets names TP worker 1 as its rank", function()
      local failure = run_failing({ env = { "WSYNC_RUNTIME_FAULT=worker1:crash@load_chunk#2" }, survivors = 2,
        label = "worker1:crash@load_chunk#2" })
      assert.matches("^%[phase chunks, rank 1%] publication of model version 1 failed in chunks: ", failure)
      assert.matches("TP worker 1 %(pid %d+%) broken during load_chunk", failure)
    end)

    -- A worker's start_update and finish_update come with its first and last
    -- load_chunk: their faults fire there.
    for _, command in ipairs({ "start_update", "finish_update" }) do
      it("worker1:crash@" .. command .. ": fires at the load_chunk that carries it", function()
        local spec = "worker1:crash@" .. command
        local failure = run_failing({ env = { "WSYNC_RUNTIME_FAULT=" .. spec }, survivors = 2, label = spec })
        assert.matches("^%[phase chunks, rank 1%] publication of model version 1 failed in chunks: ", failure)
        assert.matches("TP worker 1 %(pid %d+%) broken during load_chunk", failure)
      end)
    end

    -- A TP worker that stops (SIGSTOP: alive, answering nothing) is named
    -- with its pid and the command: the runtime's main process waits for it
    -- a little less than the host waits for the main process (80% of the
    -- recipe's 2 s for load_chunk).
    it("worker1:stop@load_chunk#2: names TP worker 1, its pid and load_chunk, within the recipe's timeout", function()
      local failure, result = run_failing({ env = { "WSYNC_RUNTIME_FAULT=worker1:stop@load_chunk#2" },
        survivors = 2, label = "worker1:stop@load_chunk#2" })
      assert.matches("^%[phase chunks, rank 1%] publication of model version 1 failed in chunks: reference runtime "
        .. "broken during load_chunk: load_chunk failed: WORKER_FAILED: TP worker 1 %(pid %d+%) broken during "
        .. "load_chunk: timeout: no answer to load_chunk within 1%.6 s$", failure)
      assert.is_true(result.wall < 12, string.format("took %.1f s", result.wall))
    end)

    it("worker1:stop@info#1: a TP worker stopped before its handshake is named; the runtime does not start",
      function()
        local failure, result = run_failing({ env = { "WSYNC_RUNTIME_FAULT=worker1:stop@info#1" }, survivors = 2,
          recipe = fixtures.recipes .. "/publish_stop.lua", label = "worker1:stop@info#1" })
        assert.matches("^reference runtime did not start: .*TP worker 1 %(pid %d+%) broken during info: timeout: no "
          .. "answer to info within 4 s$", failure)
        assert.is_true(result.wall < 15, string.format("took %.1f s", result.wall))
      end)

    it("wrong_protocol@start_update: fails in start, naming both protocol versions", function()
      local failure = run_failing({ env = { "WSYNC_RUNTIME_FAULT=wrong_protocol@start_update" }, survivors = 2,
        label = "wrong_protocol@start_update" })
      assert.matches("^%[phase start%] publication of model version 1 failed in start: reference runtime broken "
        .. "during start_update: peer speaks protocol %d+, this side speaks %d+$", failure)
    end)

    -- A socket path the recipe fixes names no host pid, as the host's own
    -- does: the synthetic ranks know the host that started them by its
    -- guard's mark, and do not repeat its failure either.
    it("crash@load_chunk#2 with control.endpoint=PATH: the failure is printed once too", function()
      local directory = assert(uv.fs_mkdtemp((os.getenv("TMPDIR") or "/tmp") .. "/wsync-endpoint-XXXXXX"))
      local path = directory .. "/wsync.sock"
      local ok, err = pcall(function()
        local failure, result = run_failing({ env = { "WSYNC_RUNTIME_FAULT=crash@load_chunk#2" },
          words = { "control.endpoint=" .. path }, survivors = 2, label = "crash@load_chunk#2, control.endpoint" })
        assert.matches("\nwsync: control endpoint " .. escape(path) .. "\n", result.stdout)
        assert.matches("reference runtime broken during load_chunk: ", failure, 1, true)
        assert.is_nil(uv.fs_stat(path), "the host removed its socket")
      end)
      os.remove(path)
      uv.fs_rmdir(directory)
      assert(ok, err)
    end)
  end)

  describe("in a trainer rank", function()
    it("rank1:die@fill#2: rank 1 dies filling chunk 2; rank 0 gets the error", function()
      local failure = run_failing({ env = { "WSYNC_TRAINER_FAULT=rank1:die@fill#2" }, survivors = 1,
        label = "rank1:die@fill#2" })
      assert.matches("^%[phase chunks, rank 1%] publication of model version 1 failed in chunks: trainer rank 1: ",
        failure)
      assert.matches("closed the connection (during fill)", failure, 1, true)
    end)

    -- A rank that stops (SIGSTOP: alive, answering nothing) is noticed when
    -- the command it does not answer times out (5 s in the fixture); then
    -- everything ends fail-stop: the stopped rank is killed and reaped, the
    -- other rank hears the error, nothing is left.
    for _, case in ipairs({
      { at = "fill#1", phase = "chunks", cmd = "fill" }, -- (the fill that begins the publication)
      { at = "fill#2", phase = "chunks", cmd = "fill" },
      { at = "callback#1", phase = "callback", cmd = "callback" },
    }) do
      local spec = "rank1:stop@" .. case.at
      it(spec .. ": a stopped rank fails the run within the timeout of " .. case.cmd .. "; it is killed", function()
        local failure, result = run_failing({ env = { "WSYNC_TRAINER_FAULT=" .. spec }, survivors = 1, label = spec })
        assert.matches("^%[phase " .. case.phase .. ", rank 1%] ", failure)
        assert.matches("trainer rank 1: agent pid %d+: timeout: no answer to " .. case.cmd .. " within 5 s", failure)
        assert.matches("\nwsync: trainer rank 1 %(pid %d+%) did not exit: killed\n", result.stdout)
        assert.is_true(result.wall < 15, string.format("took %.1f s", result.wall))
      end)
    end

    it("rank1:stop@publish#2: rank 0 waits in publish; rank 1 never comes; the run fails after timeouts.publish",
      function()
        local failure, result = run_failing({ env = { "WSYNC_TRAINER_FAULT=rank1:stop@publish#2" }, survivors = 1,
          recipe = fixtures.recipes .. "/publish_stop.lua", label = "rank1:stop@publish#2", published = 1 })
        assert.are.equal("[phase publish, rank 1] trainer rank 1 did not call publish within 3 s of the first "
          .. "rank's call (timeouts.publish)", failure)
        assert.is_true(result.wall < 12, string.format("took %.1f s", result.wall))
      end)

    it("stop@publish#2: no rank comes back from training; the run fails after timeouts.train_step", function()
      local failure, result = run_failing({ env = { "WSYNC_TRAINER_FAULT=stop@publish#2" }, survivors = 0,
        recipe = fixtures.recipes .. "/publish_stop.lua", label = "stop@publish#2", published = 1 })
      assert.are.equal("[phase training] no trainer rank called publish within 3 s of the last publication "
        .. "(timeouts.train_step)", failure)
      assert.is_true(result.wall < 12, string.format("took %.1f s", result.wall))
    end)

    it("rank1:die@fill#2 with respawn: no new runtime for a world short of a rank; rank 0 stops too", function()
      local failure, result = run_failing({ env = { "WSYNC_TRAINER_FAULT=rank1:die@fill#2" }, survivors = 1,
        recipe = fixtures.recipes .. "/publish_respawn.lua", label = "rank1:die@fill#2 respawn" })
      assert.matches("^%[phase chunks, rank 1%] publication of model version 1 failed in chunks: ", failure)
      assert.is_nil(result.stdout:find("respawning", 1, true), result.stdout)
    end)

    it("rank0:fail@fill#1: rank 0 answers its first fill with an error", function()
      local failure = run_failing({ env = { "WSYNC_TRAINER_FAULT=rank0:fail@fill#1" }, survivors = 2,
        label = "rank0:fail@fill#1" })
      assert.matches("^%[phase chunks, rank 0%] publication of model version 1 failed in chunks: trainer rank 0: "
        .. "rank 0: injected fill failure$", failure)
    end)

    it("drop_expert: the packed experts registered one expert short are refused at registration", function()
      local failure, result = run_failing({ env = { "WSYNC_TRAINER_FAULT=drop_expert" }, survivors = 2,
        label = "drop_expert" })
      -- (Once both registered: the lowest rank's; the runtime never starts.)
      assert.are.equal("[phase registration, rank 0] trainer rank 0 registered "
        .. "model.layers.0.mlp.experts.gate_up_proj as bfloat16 3x64x64; the model config says bfloat16 4x64x64",
        failure)
      assert.is_nil(result.stdout:find("starting the reference runtime", 1, true), result.stdout)
    end)

    it("a device without the free memory the buffers need is refused before anything moves", function()
      local failure = run_failing({ recipe = fixtures.recipes .. "/publish_no_memory.lua", survivors = 2,
        label = "no free memory" })
      assert.matches("^%[phase preflight, rank 0%] trainer rank 0's device has %d+ bytes free; the buffers need "
        .. "1125899907298304 %(2 x 163840 %+ largest tensor 128000 %+ headroom 1125899906842624%)$", failure)
    end)

    it("rank1:wrong_device: two ranks on one device are refused before anything moves", function()
      local failure = run_failing({ env = { "WSYNC_TRAINER_FAULT=rank1:wrong_device" }, survivors = 2,
        label = "rank1:wrong_device" })
      assert.matches("^%[phase preflight, rank 1%] trainer ranks 0 and 1 share device [%x-]+: one device per rank$",
        failure)
    end)

    -- Every rank reporting the next rank's device is a permutation, not an
    -- error: the host starts TP worker r on trainer rank r's device, so rank r
    -- and worker r still share one device (the preflight compares UUIDs in
    -- rank order, and the receipts carry the workers' UUIDs).
    it("wrong_device on every rank: the runtime follows the permuted devices and publishes", function()
      local result = leftovers.run({ "run", RECIPE }, { env = { "WSYNC_TRAINER_FAULT=wrong_device" } })
      timings[#timings + 1] = { label = "wrong_device", wall = result.wall }
      leftovers.assert_clean(result)
      assert.are.equal(0, result.code, result.stderr)
      assert.matches("\nwsync: verdict: OK: 2 model versions published", result.stdout)
    end)
  end)

  describe("in the recipe", function()
    -- Refused as `wsync check` refuses them, before a process starts.
    local function run_refused(name, label)
      local path = fixtures.recipes .. "/" .. name
      local result = leftovers.run({ "run", path })
      timings[#timings + 1] = { label = label, wall = result.wall }
      leftovers.assert_clean(result)
      assert.are.same({ [result.pid] = true }, result.pids, "the run started processes")
      assert.are.equal(3, result.code)
      assert.are.equal("", result.stdout)
      local line = fixtures.bad_line(path)
      assert.matches("^wsync: " .. escape(path) .. ":" .. line .. ": [^\n]+\n$", result.stderr)
      return result.stderr
    end

    it("a tensor larger than the buffer: exits 3 naming the tensor and both byte counts", function()
      local stderr = run_refused("publish_small_buffer.lua", "tensor larger than the buffer")
      assert.matches("tensor model.embed_tokens.weight needs 128000 bytes (125.00 KiB) in one piece; the buffer "
        .. "holds 102400", stderr, 1, true)
    end)

    it("a schedule over budget: exits 3 naming the step and both byte counts", function()
      local stderr = run_refused("publish_over_budget.lua", "schedule over budget")
      assert.matches("schedule[5] (wake kv_cache) needs 1534272 bytes (1.46 MiB) on each device; the budget is "
        .. "1468006 bytes", stderr, 1, true)
    end)
  end)
end)
