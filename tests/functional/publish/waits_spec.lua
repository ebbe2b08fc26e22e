-- No silent waits: while `wsync run` waits longer than a few seconds it says
-- what it waits for, at growing intervals ($WSYNC_PROGRESS_AFTER = 1 here:
-- after 1 s, 2 s, 4 s...), naming the rank or the runtime, the command, the
-- seconds so far, the deadline and the phase; and a failure is printed
-- once, in the verdict (not again on stderr by the host, nor by the
-- synthetic ranks it started). Each case is a peer that stops or hangs, with
-- the short timeouts of the fault fixtures.
local fixtures = require("tests.helpers.fixtures")
local leftovers = require("tests.helpers.leftovers")

local RECIPES = fixtures.recipes

local function escape(text)
  return (text:gsub("%p", "%%%0"))
end

-- Runs the recipe with `env` (and progress after 1 s); returns the result,
-- the seconds of every line that matches `pattern` (its capture), and the
-- failed verdict, which it checks is printed once.
local function run(recipe, env, pattern)
  env = { "WSYNC_PROGRESS_AFTER=1", unpack(env or {}) }
  local result = leftovers.run({ "run", RECIPES .. "/" .. recipe }, { env = env, timeout = 30000 })
  leftovers.assert_clean(result)
  assert.are.equal(1, result.code, result.stdout .. result.stderr)
  local seconds = {}
  for line in result.stdout:gmatch("[^\n]+") do
    local waited = line:match(pattern)
    if waited then
      seconds[#seconds + 1] = tonumber(waited)
    end
  end
  local failure = result.stdout:match("\nwsync: verdict: FAILED: ([^\n]*)\n")
  assert.is_not_nil(failure, result.stdout)
  local _, times = (result.stdout .. result.stderr):gsub(escape(failure), "")
  assert.are.equal(1, times, "the failure is printed more than once:\n" .. result.stdout .. result.stderr)
  assert.are.equal("", result.stderr)
  return result, seconds, failure
end

-- The progress lines came at about `expected` seconds (a loaded machine may
-- run a timer late, never early).
local function assert_at(expected, seconds, output)
  assert.are.equal(#expected, #seconds, output)
  for index, at in ipairs(expected) do
    assert.is_true(seconds[index] >= at and seconds[index] <= at + 1, string.format("line %d at %s s, not %d s:\n%s",
      index, tostring(seconds[index]), at, output))
  end
end

describe("wsync run says what it waits for", function()
  it("a trainer rank stopped during a fill: named with its pid, the command and the deadline, then one failure",
    function()
      local result, seconds, failure = run("publish_faults.lua", { "WSYNC_TRAINER_FAULT=rank1:stop@fill#2" },
        "^wsync: waiting for trainer rank 1 %(pid %d+%) to answer fill: (%d+) s so far, deadline 5 s %(phase "
        .. "chunks of model version 1, round 1%)$")
      assert_at({ 1, 2, 4 }, seconds, result.stdout)
      assert.matches("^%[phase chunks, rank 1%] publication of model version 1 failed in chunks: trainer rank 1: "
        .. "agent pid %d+: timeout: no answer to fill within 5 s", failure)
      -- Where it failed, said as it happened (the why is the verdict's).
      assert.matches("\nwsync: round 1 %(model version 1%) failed in chunks, rank 1: stopping the session, "
        .. "fail%-stop %(the verdict says why%)\n", result.stdout)
    end)

  it("a hung runtime command: the runtime named with its pid", function()
    local result, seconds = run("publish_faults.lua", { "WSYNC_RUNTIME_FAULT=hang@load_chunk#2" },
      "^wsync: waiting for the reference runtime %(pid %d+%) to answer load_chunk: (%d+) s so far, deadline 2 s "
      .. "%(phase chunks of model version 1, round 1%)$")
    assert_at({ 1 }, seconds, result.stdout)
  end)

  it("the runtime's startup, a TP worker of it stopped before its handshake", function()
    local result, seconds, failure = run("publish_stop.lua", { "WSYNC_RUNTIME_FAULT=worker1:stop@info#1" },
      "^wsync: waiting for the reference runtime %(pid %d+%) to answer info %(its startup handshake%): (%d+) s so "
      .. "far, deadline 5 s %(phase runtime start%)$")
    assert_at({ 1, 2, 4 }, seconds, result.stdout)
    assert.matches("^reference runtime did not start: ", failure)
  end)

  it("registration: the ranks that have not registered", function()
    local result, seconds, failure = run("external_short_registration.lua", {},
      "^wsync: waiting for the trainer ranks to register: 0 of 2 so far %(ranks 0, 1 missing%): (%d+) s so far, "
      .. "deadline 3 s %(timeouts%.registration%)$")
    assert_at({ 1, 2 }, seconds, result.stdout)
    assert.are.equal("0 of 2 trainer ranks registered within 3 s (timeouts.registration)", failure)
  end)

  it("the training step: no rank calls publish again", function()
    local result, seconds = run("publish_stop.lua", { "WSYNC_TRAINER_FAULT=stop@publish#2" },
      "^wsync: waiting for the trainer ranks' next publish %(the training step; no rank called it yet%): (%d+) s so "
      .. "far, deadline 3 s %(timeouts%.train_step%)$")
    assert_at({ 1, 2 }, seconds, result.stdout)
  end)

  it("the other ranks' publish, once one rank called it", function()
    local result, seconds = run("publish_stop.lua", { "WSYNC_TRAINER_FAULT=rank1:stop@publish#2" },
      "^wsync: waiting for trainer rank 1 to call publish %(rank 0 did%): (%d+) s so far, deadline 3 s "
      .. "%(timeouts%.publish%)$")
    assert_at({ 1, 2 }, seconds, result.stdout)
  end)
end)
