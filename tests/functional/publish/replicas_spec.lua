-- Several rollout replicas (runtime.replicas): trainer world = replicas x TP,
-- trainer rank r feeding TP worker r % TP of replica r // TP on its device,
-- each replica its own runtime, a version committed only once every replica
-- finished it, and a failure in any replica destroying all of them.
local faults = require("tests.helpers.faults")
local fixtures = require("tests.helpers.fixtures")
local leftovers = require("tests.helpers.leftovers")
local process = require("tests.helpers.process")
local cjson = require("cjson")

describe("wsync run with several rollout replicas", function()
  for _, case in ipairs({
    { recipe = "replicas.lua", shape = "2 trainer ranks -> 2 x TP1", receipts = "2/2", verified = "42 tensors on 2" },
    { recipe = "replicas_tp2.lua", shape = "4 trainer ranks -> 2 x TP2", receipts = "4/4",
      verified = "84 tensors on 4" },
  }) do
    it(case.recipe .. ": publishes three versions into every replica, every resident slice of each verified",
      function()
        local result = leftovers.run({ "run", fixtures.recipes .. "/" .. case.recipe }, { timeout = 60000 })
        leftovers.assert_clean(result)
        assert.are.equal(0, result.code, result.stderr)
        assert.matches(case.shape .. " reference runtime", result.stdout, 1, true)
        local _, published = result.stdout:gsub("receipts " .. case.receipts .. "; resident weights verified %("
          .. case.verified .. " workers%)", "")
        assert.are.equal(3, published, result.stdout)
        assert.matches("verdict: OK: 3 model versions published", result.stdout, 1, true)
      end)
  end

  -- A fault in one replica fails the publication on all: nothing committed,
  -- every replica's tree destroyed, every rank told.
  for _, case in ipairs({
    { replica = 1, spec = "crash@load_chunk#2", phase = "chunks", says = "the control channel closed (EOF)" },
    { replica = 0, spec = "hang@finish_update", phase = "finish", says = "timeout: no answer to finish_update" },
    { replica = 1, spec = "garbage@start_update", phase = "start", says = "undecodable frame" },
  }) do
    it(string.format("a fault in replica %d (%s) fails the publication on every replica, naming it", case.replica,
      case.spec), function()
      local failure = faults.run_failing({ recipe = fixtures.recipes .. "/replicas_faults.lua",
        env = { string.format("WSYNC_RUNTIME_FAULT_%d=%s", case.replica, case.spec) }, survivors = 4,
        label = case.spec })
      assert.matches("^%[phase " .. case.phase, failure)
      assert.matches(string.format("replica %d: reference runtime broken during ", case.replica), failure, 1, true)
      assert.matches(case.says, failure, 1, true)
    end)
  end

  it("recipes/demo_async.lua: two replicas generating across ten publications, paused around each", function()
    local result = leftovers.run({ "run", "recipes/demo_async.lua" }, { timeout = 60000 })
    leftovers.assert_clean(result)
    assert.are.equal(0, result.code, result.stderr)
    assert.matches("2 trainer ranks -> 2 x TP1 reference runtime", result.stdout, 1, true)
    assert.matches("verdict: OK: 10 model versions published, every resident TP slice verified", result.stdout, 1,
      true)
    -- What it demonstrates: requests streaming across the publications, each
    -- round's tokens and the versions that produced them, the pauses timed.
    assert.matches("4 requests stream in the rollout runtime (rollout.stream)", result.stdout, 1, true)
    -- (The first round may end before any request's first token; from the
    -- second on they have tokens.)
    assert.matches("round 1: 4 streaming requests produced %d+ tokens since the last round; ", result.stdout)
    for round = 2, 10 do
      assert.matches("round " .. round .. ": 4 streaming requests produced %d+ tokens since the last round; request "
        .. "%d+'s versions: [^\n]*v%d+ tokens %d+%-%d+", result.stdout)
    end
    assert.matches("(kv recomputed)", result.stdout, 1, true)
    assert.matches("pause keep (kv recompute)", result.stdout, 1, true)
  end)

  it("pauses every replica around each publication while they generate (two phases)", function()
    local result = leftovers.run({ "run", fixtures.recipes .. "/replicas_generating.lua" }, { timeout = 60000 })
    leftovers.assert_clean(result)
    assert.are.equal(0, result.code, result.stderr)
    assert.matches("verdict: OK: 2 model versions published", result.stdout, 1, true)
  end)

  -- Phase 1 fails: a replica that does not pause (stalled in its step) or
  -- fails to fails the round before any weight moved; it is destroyed, the
  -- others resume, no version is issued.
  for _, case in ipairs({
    { spec = "hang@pause", says = "replica 1 did not pause: reference runtime broken during pause: timeout: no "
      .. "answer to pause within 2 s; the other replicas resumed, no weight moved" },
    { spec = "error@pause", says = "replica 1 did not pause: reference runtime: pause failed: INJECTED" },
  }) do
    it("a replica that does not pause (" .. case.spec .. ") fails the round before any weight moved", function()
      local failure = faults.run_failing({ recipe = fixtures.recipes .. "/replicas_generating.lua",
        env = { "WSYNC_RUNTIME_FAULT_1=" .. case.spec }, survivors = 2, label = case.spec })
      assert.matches(case.says, failure, 1, true)
    end)
  end

  it("a replica that dies while paused fails the publication on every replica", function()
    local failure = faults.run_failing({ recipe = fixtures.recipes .. "/replicas_generating.lua",
      env = { "WSYNC_RUNTIME_FAULT_1=crash@start_update" }, survivors = 2, label = "crash@start_update" })
    assert.matches("^%[phase start%] publication of model version 1 failed in start: replica 1: reference runtime "
      .. "broken during start_update", failure)
  end)

  it("1,000 pause/publish/resume rounds with requests streaming over both replicas lose and repeat no token",
    function()
      local result = process.wsync({ "tests/functional/publish/replicas_soak.lua",
        fixtures.recipes .. "/replicas_soak.lua" }, nil, { timeout = 300000 })
      assert.are.equal(0, result.code, result.stderr)
      local line = ("\n" .. result.stdout):match("\nSOAK ([^\n]+)")
      assert.is_not_nil(line, result.stdout)
      local summary = cjson.decode(line)
      assert.are.equal(1000, summary.rounds)
      assert.are.same({}, summary.problems)
      assert.are.equal(4, #summary.requests)
      local per_replica = { [0] = 0, [1] = 0 }
      for index, request in ipairs(summary.requests) do
        assert.are.equal(index, request.id, "each request once, across the replicas")
        per_replica[request.replica] = per_replica[request.replica] + 1
        assert.are.equal(request.generated, request.tokens, "every token generated was polled once")
        assert.is_true(request.contiguous, "its spans cover its tokens, in order")
        assert.is_true(request.generated >= 500)
        assert.are.equal(1000, request.last_version)
        assert.is_true(request.spans >= 500, "tokens from most versions: " .. request.spans)
      end
      assert.are.same({ [0] = 2, [1] = 2 }, per_replica, "balanced: two requests on each replica")
    end)

  it("balances generation over the replicas: each prompt on one, the outputs in the prompts' order", function()
    local path = os.tmpname()
    local file = assert(io.open(path, "w"))
    file:write([[
local cjson = require("cjson")
local s = require("wsync.publish.session").open(require("wsync.recipe").load(...))
s:wait_publish()
local result = s.rollout:request("generate", { prompts = { { 1 }, { 2 }, { 3 } }, sampling = { max_tokens = 4 } })
local single = s.rollout.replicas[1]:request("generate", { prompts = { { 1 }, { 2 }, { 3 } },
  sampling = { max_tokens = 4 } })
io.stdout:write("GENERATED ", cjson.encode({ per_replica = { #result.replicas[1].outputs,
  #result.replicas[2].outputs }, same = cjson.encode(result.outputs[3].token_ids)
  == cjson.encode(single.outputs[3].token_ids), outputs = #result.outputs }), "\n")
s:close()
]])
    file:close()
    local result = process.wsync({ path, fixtures.recipes .. "/replicas_generating.lua" }, nil, { timeout = 60000 })
    os.remove(path)
    assert.are.equal(0, result.code, result.stderr)
    local line = ("\n" .. result.stdout):match("\nGENERATED ([^\n]+)")
    assert.is_not_nil(line, result.stdout)
    assert.are.same({ per_replica = { 2, 1 }, same = true, outputs = 3 }, cjson.decode(line))
  end)

  it("check and run refuse a trainer world other than replicas x TP, naming runtime.replicas", function()
    local path = fixtures.recipes .. "/replicas_mismatch.lua"
    for _, command in ipairs({ "check", "run" }) do
      local result = process.wsync({ command, path })
      assert.are.equal(3, result.code, result.stderr)
      assert.matches(string.format("%s:%d: field 'runtime.replicas': 2 replicas x TP 2 make 4 TP workers for 3 "
        .. "trainer ranks", path, fixtures.bad_line(path)), result.stderr, 1, true)
    end
  end)

  it("check prints the replicas", function()
    local result = process.wsync({ "check", fixtures.recipes .. "/replicas_tp2.lua" })
    assert.are.equal(0, result.code, result.stderr)
    assert.matches("FSDP4 -> 2 x TP2", result.stdout, 1, true)
    assert.matches("runtime      reference 2 replicas x TP2", result.stdout, 1, true)
  end)
end)
