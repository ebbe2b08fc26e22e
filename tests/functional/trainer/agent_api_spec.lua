-- libwsync's agent API end to end: `wsync run` on a recipe with external
-- trainer ranks, and two trainer ranks written in C (tests/embed/agent_example.c)
-- that embed wsync through the agent API, connect to the endpoint the host
-- printed, register their shards and callbacks and publish.
--
-- The example's path comes from $WSYNC_AGENT_EXAMPLE, which CTest's functional
-- tier sets; without it every test here fails and says so.
local uv = require("luv")
local leftovers = require("tests.helpers.leftovers")
local process = require("tests.helpers.process")

local RECIPE = "tests/fixtures/recipes/external_tiny.lua"
local WORLD = 2
local VERSIONS = 3

local function agent_example()
  local path = os.getenv("WSYNC_AGENT_EXAMPLE")
  assert(path ~= nil and path ~= "", "WSYNC_AGENT_EXAMPLE is not set: run this spec through CTest (ctest "
    .. "--test-dir build -R functional), or set it to the agent_example binary of the build")
  assert(uv.fs_access(path, "X"), "WSYNC_AGENT_EXAMPLE=" .. path .. " is not an executable file")
  return path
end

-- Processes the running test started, and the timer that watches for them;
-- after_each ends whatever a failing test left.
local started = {}
local watcher = nil

local function start(program, args, env)
  local proc = process.start(program, args, env)
  started[#started + 1] = proc
  return proc
end

local drive = process.drive

local function describe_proc(proc)
  return string.format("%s (pid %d) exited %s/%s\nstdout:\n%s\nstderr:\n%s", proc.program, proc.pid,
    tostring(proc.code), tostring(proc.signal), proc.stdout, proc.stderr)
end

-- One session: the host on the fixture recipe, then WORLD agent_example ranks
-- on the endpoint it printed. Options: `failing = {rank, callback, how?}` makes
-- that rank's callback fail (`how`: agent_example's HOW); `step_ms` is each training step's time;
-- `kill_host_when(host, agents)` kills the host with SIGKILL once it holds.
-- Waits until every process ended and checks that nothing is left: no
-- process that carried the session's mark, no segment in /dev/shm of any of
-- them. Returns the host and the agents (by rank, 1-based).
local function run_session(options)
  options = options or {}
  local failing = options.failing
  local example = agent_example()
  local mark = string.format("WSYNC_AGENT_API_SPEC=%d-%d", uv.os_getpid(), uv.hrtime())
  local seen = {}
  watcher = uv.new_timer()
  watcher:start(0, 10, function()
    for _, pid in ipairs(leftovers.with_environment(mark)) do
      seen[pid] = true
    end
  end)
  local host = start(process.wsync_binary(), { "run", RECIPE }, { mark })
  local endpoint = nil
  drive(function()
    endpoint = host.stdout:match("waiting for %d+ external trainer ranks on (%S+)\n")
    return endpoint ~= nil or host.done
  end, 30000, "the host's endpoint")
  assert(endpoint, "the host did not print its endpoint: " .. describe_proc(host))
  local agents = {}
  for rank = 0, WORLD - 1 do
    local args = { endpoint, tostring(rank), tostring(WORLD), tostring(VERSIONS), tostring(options.step_ms or 0) }
    if failing and failing.rank == rank then
      args[#args + 1] = failing.callback
      args[#args + 1] = failing.how
    end
    agents[rank + 1] = start(example, args, { mark })
  end
  drive(function()
    if options.kill_host_when and not host.killed and options.kill_host_when(host, agents) then
      host.killed = true
      host.handle:kill("sigkill")
    end
    for _, proc in ipairs(started) do
      if not proc.done then
        return false
      end
    end
    return true
  end, 60000, "the host and the agents to exit")
  -- The host reaps its runtime before it exits; give the kernel a moment to
  -- drop what it reaped from /proc.
  local deadline = uv.hrtime() + 2e9
  while #leftovers.with_environment(mark) > 0 and uv.hrtime() < deadline do
    uv.sleep(10)
  end
  watcher:close()
  watcher = nil
  uv.run("nowait")
  -- What outlived the session is removed before the test fails on it, so
  -- that no later test trips over it.
  local live = leftovers.with_environment(mark)
  for _, pid in ipairs(live) do
    uv.kill(pid, "sigkill")
  end
  local segments = leftovers.segments_of(seen)
  for _, name in ipairs(segments) do
    uv.fs_unlink("/dev/shm/" .. name)
  end
  assert.are.same({}, live, "processes of the session outlived it")
  local seen_count = 0
  for _ in pairs(seen) do
    seen_count = seen_count + 1
  end
  assert.is_true(seen_count >= 1 + WORLD, "the session's processes were not seen")
  assert.are.same({}, segments, "shared-memory segments outlived the session")
  return host, agents
end

-- Lines "agent_example rank R: published version V: model version M,
-- publication ID, manifest H, receipts K" by version.
local function publications(agent)
  local by_version = {}
  for version, model_version, id, manifest, receipts in agent.stdout:gmatch(
    "published version (%d+): model version (%d+), publication (%x+), manifest (%x+), receipts (%d+)") do
    by_version[tonumber(version)] = {
      model_version = tonumber(model_version), publication_id = id, manifest = manifest,
      receipts = tonumber(receipts),
    }
  end
  return by_version
end

describe("the agent API (libwsync, trainer ranks in C)", function()
  after_each(function()
    if watcher then
      watcher:close()
      watcher = nil
    end
    local left = started
    started = {}
    for _, proc in ipairs(left) do
      process.finish(proc)
    end
  end)

  it("publishes every version from two C ranks into the runtime and verifies every resident slice", function()
    local host, agents = run_session()
    assert.are.equal(0, host.code, describe_proc(host))
    assert.matches("verdict: OK: " .. VERSIONS .. " model versions published, every resident TP slice verified",
      host.stdout, 1, true)
    local manifest = host.stdout:match("manifest (%x+)\n")
    for version = 1, VERSIONS do
      assert.matches(string.format("published model version %d %%(step %d%%):.*resident weights verified "
        .. "%%(42 tensors on 2 workers%%)", version, version), host.stdout)
    end
    local first = nil
    for rank, agent in ipairs(agents) do
      assert.are.equal(0, agent.code, describe_proc(agent))
      assert.matches(string.format("agent_example rank %d: registered 25 tensors", rank - 1), agent.stdout, 1, true)
      local by_version = publications(agent)
      local ids = {}
      for version = 1, VERSIONS do
        local result = by_version[version]
        assert.is_table(result, describe_proc(agent))
        assert.are.equal(version, result.model_version)
        assert.are.equal(32, #result.publication_id)
        assert.are.equal(manifest, result.manifest)
        assert.are.equal(WORLD, result.receipts)
        assert.is_nil(ids[result.publication_id], "a publication id came twice")
        ids[result.publication_id] = true
      end
      first = first or by_version
      assert.are.same(first, by_version, "ranks 0 and " .. rank - 1 .. " saw different publications")
    end
    -- The host's last receipt names the last publication the ranks saw.
    assert.matches("last receipt %(TP rank 0%): publication " .. first[VERSIONS].publication_id, host.stdout)
  end)

  -- Runs a session whose rank 1 fails `callback` (agent_example's HOW `how`);
  -- checks that every rank's publish 1 failed with the host's error, the same
  -- on each, and returns that text.
  local function failed_callback(callback, how)
    local host, agents = run_session({ failing = { rank = 1, callback = callback, how = how } })
    assert.are_not.equal(0, host.code, describe_proc(host))
    local verdict = host.stdout:match("verdict: FAILED: ([^\n]+)")
    assert.is_string(verdict, describe_proc(host))
    assert.matches("callback '" .. callback .. "'", verdict, 1, true)
    local texts = {}
    for rank, agent in ipairs(agents) do
      assert.are.equal(1, agent.code, describe_proc(agent))
      assert.are.same({}, publications(agent))
      local status, text = agent.stdout:match("publish 1 failed %(status (%-%d+)%): ([^\n]+)")
      assert.is_string(text, describe_proc(agent))
      assert.are.equal("-14", status) -- WS_EFAILED
      texts[rank] = text
    end
    assert.are.equal(texts[1], texts[2], "the ranks read different errors")
    -- The host's error (phase, rank, cause) with its code.
    assert.are.equal(verdict .. " (CALLBACK_FAILED)", texts[1])
    return texts[1], agents
  end

  -- (agent_example registers the optimizer's callbacks with
  -- ws_agent_register_callback, the actor's with
  -- ws_agent_register_confirmed_callback.)
  for _, callback in ipairs({ "offload_optimizer", "offload_actor" }) do
    it("fails every rank's publish with the same error when one rank's callback fails (" .. callback .. ")",
      function()
        local text, agents = failed_callback(callback)
        assert.matches("^%[phase callback, rank 1%] trainer rank 1: callback '" .. callback .. "' failed %(it "
          .. "returned 1%)", text)
        assert.matches("agent_example rank 1: " .. callback .. " fails on purpose", agents[2].stderr, 1, true)
      end)
  end

  it("fails the step of a confirmed callback that returned without confirming its end", function()
    local text, agents = failed_callback("offload_actor", "unfinished")
    assert.are.equal("[phase callback, rank 1] trainer rank 1: callback 'offload_actor' was interrupted before it "
      .. "completed (it did not report done) (CALLBACK_FAILED)", text)
    assert.matches("agent_example rank 1: offload_actor does not finish on purpose", agents[2].stderr, 1, true)
  end)

  it("fails the next publish, without SIGPIPE, when the host dies between publications", function()
    local host, agents = run_session({
      step_ms = 300,
      -- Both ranks have version 1 and train for the next one: the host dies
      -- while neither runs its loop, so each finds out when it writes.
      kill_host_when = function(_, ranks)
        for _, agent in ipairs(ranks) do
          if not agent.stdout:find("published version 1:", 1, true) then
            return false
          end
        end
        return true
      end,
    })
    assert.are.equal(9, host.signal, describe_proc(host))
    for _, agent in ipairs(agents) do
      assert.are.equal(0, agent.signal, "killed by a signal: " .. describe_proc(agent))
      assert.are.equal(1, agent.code, describe_proc(agent))
      assert.is_table(publications(agent)[1])
      assert.matches("publish 2 failed %(status %-14%): [^\n]*rank %d: the wsync host at [^\n]*/control.sock "
        .. "%(pid " .. host.pid .. "%) [^\n]*during publish; this rank's session has "
        .. "ended %(HOST_LOST%)", agent.stdout)
    end
  end)
end)
