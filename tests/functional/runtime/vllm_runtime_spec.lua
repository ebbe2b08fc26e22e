-- The vllm runtime's main process (bindings/python/wsync/vllm), driven by the
-- host as the reference runtime is: spawned in its own process group, the
-- same protocol, states and refusals, destroyed whole when it breaks. vLLM is
-- not here: an engine in its place (tests/python/vllm_stand_in.py, named by
-- $WSYNC_VLLM_ENGINE) has TP workers that are child processes which only
-- sleep, so that the tree can be seen gone. The GPU tier runs vLLM itself.
local uv = require("luv")
local async = require("tests.helpers.async")
local faults = require("tests.helpers.faults")
local fixtures = require("tests.helpers.fixtures")
local leftovers = require("tests.helpers.leftovers")
local process_helper = require("tests.helpers.process")
local runtime_helper = require("tests.helpers.runtime")
local loop = require("wsync.loop")
local process = require("wsync._process")

local run_async = async.run_async

local ENV = { "WSYNC_VLLM_ENGINE=vllm_stand_in:Engine", "PYTHONPATH=bindings/python:tests/python" }
local STAND_IN = fixtures.recipes .. "/vllm_stand_in.lua"

local function with(extra)
  local env = {}
  for _, entry in ipairs(ENV) do
    env[#env + 1] = entry
  end
  for _, entry in ipairs(extra or {}) do
    env[#env + 1] = entry
  end
  return env
end

local runtimes = runtime_helper.tracker()

local function spawn(options)
  options = options or {}
  return runtimes.spawn({
    kind = "vllm", tp = options.tp or 2, backend = "host", model = "tests/fixtures/models/tiny",
    env = with(options.env), timeouts = options.timeouts, grace_ms = 500,
  })
end

local raised = require("tests.helpers.errors").error_of

describe("the vllm runtime (an engine in place of vLLM)", function()
  after_each(runtimes.cleanup)

  it("answers info like the reference runtime: its workers, their devices, its load mode", function()
    run_async(function()
      local client = spawn()
      local info = client.startup_info
      assert.are.equal("vllm", info.runtime)
      assert.are.equal("direct", info.load)
      assert.are.equal(1, info.protocol)
      assert.are.equal(2, info.tp_world)
      assert.are.equal(0, info.model_version)
      assert.is_true(info.capabilities.generate)
      assert.are.same({ weights = "awake", kv_cache = "reserved" }, info.state)
      for rank, worker in ipairs(info.workers) do
        assert.are.equal(rank - 1, worker.rank)
        assert.is_true(runtime_helper.exists(worker.pid))
        assert.are.equal(require("wsync.native.device").query("host", rank - 1).uuid, worker.device.uuid)
      end
      assert.is_true(client:close())
      assert.are.same({ code = 0, signal = 0 }, client.exit_status)
      runtime_helper.assert_tree_gone(client.group, client.pid, runtime_helper.worker_pids(info))
    end)
  end)

  it("sleeps, wakes, and generates only with weights awake and the KV cache reserved", function()
    run_async(function()
      local client = spawn()
      local asleep = client:request("sleep", { level = 1 })
      assert.are.same({ weights = "offloaded", kv_cache = "free" }, asleep.state)
      local refused = raised(client.request, client, "generate", { prompts = { { 1, 2 } } })
      assert.are.equal("STATE_REFUSED", refused.remote_code)
      assert.matches("weights are offloaded", refused.message, 1, true)
      assert.are.equal("IDLE", client.state, "a refused generate does not break the runtime")
      assert.are.equal("awake", client:request("wake", { tags = { "weights" } }).state.weights)
      assert.are.equal("reserved", client:request("wake", { tags = { "kv_cache" } }).state.kv_cache)
      local generated = client:request("generate", { prompts = { { 1, 2, 3 }, { 4 } }, sampling = { max_tokens = 3 } })
      assert.are.equal(0, generated.model_version)
      assert.are.equal(2, #generated.outputs)
      for _, output in ipairs(generated.outputs) do
        assert.are.equal(3, #output.token_ids)
        assert.are.equal(3, #output.logprobs)
        assert.are.equal(0, output.model_version)
      end
      local bad = raised(client.request, client, "generate", { prompts = { { -1 } } })
      assert.are.equal("INVALID_ARGUMENT", bad.remote_code)
      assert.is_true(client:close())
    end)
  end)

  it("refuses an unknown command without breaking; a refused sleep or wake breaks it, as the reference's", function()
    for _, case in ipairs({
      { "sleep", { level = 3 }, "sleep level must be 1 or 2, got 3" },
      { "wake", { tags = { "weights", "lora" } }, "wake tags must be a non-empty list of weights, kv_cache" },
      { "wake", {}, "wake tags must be a non-empty list of weights, kv_cache" },
    }) do
      run_async(function()
        local client = spawn()
        local unknown = raised(client.request, client, "teleport", {})
        assert.are.equal("UNKNOWN_COMMAND", unknown.remote_code)
        assert.are.equal("IDLE", client.state)
        -- (The engine's memory state is no longer known.)
        local err = raised(client.request, client, case[1], case[2])
        assert.are.equal("RUNTIME_BROKEN", err.code)
        assert.are.equal(case[1], err.phase)
        assert.matches(case[3], err.message, 1, true)
        client:wait_dead()
        assert.are.equal(0, process.count_group(client.group))
      end)
    end
  end)

  it("refuses start_update before init_weights, and a header for another TP world", function()
    run_async(function()
      local client = spawn()
      local early = raised(client.request, client, "start_update", { header = {} })
      assert.matches("NOT_INITIALIZED", early.message, 1, true)
      assert.are.equal("BROKEN", client.state, "a failed weight command breaks the runtime")
      client:wait_dead()
      assert.are.equal(0, process.count_group(client.group))
    end)
  end)

  it("breaks when its main process is killed from outside, and its whole tree goes", function()
    run_async(function()
      local client = spawn()
      local pids = runtime_helper.worker_pids(client.startup_info)
      assert(uv.kill(client.pid, "sigkill"))
      client:wait_dead()
      assert.are.equal("BROKEN", client.state)
      -- (The host destroys the group: the orphaned workers go with it.)
      local deadline = uv.now() + 5000
      while process.count_group(client.group) > 0 and uv.now() < deadline do
        loop.sleep(10)
      end
      runtime_helper.assert_tree_gone(client.group, client.pid, pids)
      local err = raised(client.request, client, "info")
      assert.are.equal("RUNTIME_BROKEN", err.code)
    end)
  end)

  it("names an engine that does not start, and leaves nothing", function()
    run_async(function()
      local err = raised(spawn, { env = { "WSYNC_VLLM_ENGINE=no_such_module:Engine" } })
      assert.are.equal("RUNTIME_START", err.code)
      assert.matches("vllm runtime did not start: ModuleNotFoundError: No module named 'no_such_module'",
        err.message, 1, true)
    end)
  end)
end)

describe("the vllm runtime with a vLLM wsync does not support", function()
  after_each(runtimes.cleanup)

  it("refuses to start, naming the version found and the supported range, and leaves nothing", function()
    run_async(function()
      local err = raised(runtimes.spawn, {
        kind = "vllm", tp = 1, backend = "cuda", model = "tests/fixtures/models/tiny", grace_ms = 500,
        env = { "PYTHONPATH=tests/fixtures/python/vllm_0_27:bindings/python" },
      })
      assert.are.equal("RUNTIME_START", err.code)
      assert.are.equal("VLLM_UNSUPPORTED", err.cause.remote_code)
      assert.matches("vllm runtime did not start: vLLM 0.27.0 is not one wsync supports (0.26.x: ", err.message, 1,
        true)
      assert.matches("set WSYNC_VLLM_UNSUPPORTED=1 to run this one anyway", err.message, 1, true)
    end)
  end)
end)

describe("python3 -m wsync.vllm by hand", function()
  it("refuses to run without the host's channel, saying so", function()
    local result = process_helper.run({ program = "python3", args = { "-m", "wsync.vllm", "--tp", "1", "--devices",
      "0", "--model", "tests/fixtures/models/tiny" }, env = { "PYTHONPATH=bindings/python" } })
    assert.are.equal(1, result.code, result.stderr)
    assert.matches("no control channel on fd 3 (the wsync host starts this runtime", result.stderr, 1, true)
  end)
end)

describe("wsync run into the vllm runtime (an engine in place of vLLM)", function()
  it("publishes three versions, with the tree gone afterwards", function()
    local result = leftovers.run({ "run", STAND_IN }, { env = with(), timeout = 60000 })
    leftovers.assert_clean(result)
    assert.are.equal(0, result.code, result.stderr)
    assert.matches("2 trainer ranks -> TP2 vllm runtime", result.stdout, 1, true)
    assert.matches("verdict: OK: 3 model versions published", result.stdout, 1, true)
  end)

  it("loads with the direct loader into the engine's parameters, each publication checked against the trainer's "
    .. "values", function()
    local result = leftovers.run({ "run", fixtures.recipes .. "/vllm_stand_in_values.lua" }, { env = with(),
      timeout = 60000 })
    leftovers.assert_clean(result)
    assert.are.equal(0, result.code, result.stderr)
    local _, verified = result.stdout:gsub("resident weights verified %(42 tensors on 2 workers%)", "")
    assert.are.equal(3, verified, result.stdout)
  end)

  it("fails the values check when a parameter differs from what the trainer published, naming it", function()
    local result = leftovers.run({ "run", fixtures.recipes .. "/vllm_stand_in_values.lua" }, {
      env = with({ "WSYNC_STAND_IN_FAULT=finish:corrupt" }), timeout = 60000 })
    leftovers.assert_clean(result)
    assert.are_not.equal(0, result.code)
    assert.matches("verdict: FAILED: [phase resident check, rank 1] TP worker 1 holds "
      .. "model.layers.0.self_attn.qkv_proj.weight with values sum ", result.stdout, 1, true)
  end)

  it("streams across 200 keep-mode pause/publish/resume rounds over two replicas, losing and repeating no token",
    function()
      local result = process_helper.wsync({ "tests/functional/publish/replicas_soak.lua",
        fixtures.recipes .. "/vllm_stand_in_soak.lua" }, nil, { env = with(), timeout = 240000 })
      assert.are.equal(0, result.code, result.stderr)
      local line = ("\n" .. result.stdout):match("\nSOAK ([^\n]+)")
      assert.is_not_nil(line, result.stdout .. result.stderr)
      local summary = require("cjson").decode(line)
      assert.are.equal(200, summary.rounds)
      assert.are.same({}, summary.problems)
      assert.are.equal(4, #summary.requests)
      for index, request in ipairs(summary.requests) do
        assert.are.equal(index, request.id, "each request once, across the replicas")
        assert.are.equal(request.generated, request.tokens, "every token generated was polled once")
        assert.is_true(request.contiguous, "its spans cover its tokens, in order")
        assert.are.equal(200, request.last_version)
        assert.is_true(request.spans >= 100, "tokens from most versions: " .. request.spans)
      end
    end)

  -- Each fault of the engine fails the run fail-stop: non-zero, the cause
  -- named, nothing committed, nothing left.
  for _, case in ipairs({
    { fault = "load_chunk:2", says = "TP worker 0, chunk 2: injected failure" },
    { fault = "finish:receipt", says = "RECEIPT_INVALID" },
    { fault = "start:crash", says = "WORKER_DIED" },
  }) do
    it("fails fail-stop when the engine fails (" .. case.fault .. ")", function()
      local result = leftovers.run({ "run", STAND_IN }, { env = with({ "WSYNC_STAND_IN_FAULT=" .. case.fault }),
        timeout = 60000 })
      leftovers.assert_clean(result)
      assert.are_not.equal(0, result.code)
      local verdict = result.stdout:match("\nwsync: verdict: FAILED: ([^\n]*)\n")
      assert.is_not_nil(verdict, result.stdout .. result.stderr)
      assert.matches(case.says, verdict, 1, true)
      assert.is_nil(result.stdout:find("published model version", 1, true), "nothing is committed")
    end)
  end
end)

-- The reference runtime's fault matrix (tests/functional/publish/
-- publish_faults_spec.lua), run against the vllm runtime's main process: at
-- every weight command it crashes, hangs or answers garbage, and the host
-- fails the run fail-stop, naming the phase, the command and the cause,
-- committing nothing, leaving nothing.
describe("the vllm runtime under the reference runtime's fault matrix", function()
  for _, kind in ipairs(faults.KINDS) do
    for _, command in ipairs(faults.COMMANDS) do
      local spec = kind.kind .. "@" .. command.at
      it(spec .. ": fails in " .. command.phase .. ", naming the cause", function()
        local failure = faults.run_failing({ recipe = fixtures.recipes .. "/vllm_stand_in_faults.lua",
          env = with({ "WSYNC_RUNTIME_FAULT=" .. spec }), survivors = 2, label = spec })
        assert.matches("^%[phase " .. command.phase, failure)
        assert.matches("vllm runtime broken during " .. command.cmd .. ": ", failure, 1, true)
        assert.is_true(faults.says_any(failure, kind.causes), "the cause is not named: " .. failure)
      end)
    end
  end

  it("wrong_id@load_chunk#2 and bad_result@finish_update: an answer that does not fit breaks it", function()
    for _, case in ipairs({ { "wrong_id@load_chunk#2", "does not match request id" },
      { "bad_result@finish_update", "result of finish_update is a string, not an object" } }) do
      local failure = faults.run_failing({ recipe = fixtures.recipes .. "/vllm_stand_in_faults.lua",
        env = with({ "WSYNC_RUNTIME_FAULT=" .. case[1] }), survivors = 2, label = case[1] })
      assert.matches(case[2], failure, 1, true)
    end
  end)

  it("refuses a bad fault spec at its handshake, naming it", function()
    run_async(function()
      local err = raised(spawn, { env = { "WSYNC_RUNTIME_FAULT=worker1:crash@load_chunk" } })
      assert.are.equal("RUNTIME_START", err.code)
      assert.matches("bad fault spec item 'worker1:crash@load_chunk'", err.message, 1, true)
    end)
  end)
end)
