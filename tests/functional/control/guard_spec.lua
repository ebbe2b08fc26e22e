-- The guard (wsync.control.guard, `wsync guard`) with a real host process
-- (tests/fixtures/control/guarded_host.lua): a host that dies by SIGKILL or
-- exits leaving its tree takes the whole tree with it, within 10 s, a
-- grandchild in a session of its own (found by its mark) and one without the
-- mark in the tree's session (found by its session) included, and what it left in /dev/shm and
-- $TMPDIR goes too; a host that ends its tree itself hears nothing from its
-- guard; a guard killed while its host runs is started again. Every process
-- of a run is found by the mark in its environment (tests/helpers/leftovers).
local leftovers = require("tests.helpers.leftovers")
local process = require("tests.helpers.process")

local HOST = "tests/fixtures/control/guarded_host.lua"

local function describe_run(result)
  return string.format("exit %d (signal %d)\nstdout:\n%s\nstderr:\n%s", result.code, result.signal, result.stdout,
    result.stderr)
end

describe("the guard", function()
  it("ends the tree of a host killed with SIGKILL within 10 s and removes what the host left", function()
    local result = leftovers.run({ HOST, "wait" }, { signal = { after = "ready", name = "sigkill" },
      settle_ms = 10000 })
    assert.are.equal(9, result.signal, describe_run(result))
    local host, guard_pid = result.stdout:match("ready (%d+) (%d+)")
    assert.is_truthy(host, describe_run(result))
    leftovers.assert_clean(result)
    assert.is_true(result.settled < 10, string.format("the tree ended %.2f s after the host", result.settled))
    assert.matches("wsync guard: host pid " .. host .. " is gone; ended the 4 processes it had started", result.stderr)
    assert.matches("wsync guard: removed what they left: /wsync%-" .. host .. "%-0123456789abcdef, [^\n]*/wsync%-"
      .. host .. "%-%w+\n", result.stderr)
    assert.is_true(result.pids[tonumber(guard_pid)], "the guard was not seen among the run's processes")
  end)

  it("does the same where it cannot watch the host through a pidfd (it watches its parent then)", function()
    local result = leftovers.run({ HOST, "wait" }, { signal = { after = "ready", name = "sigkill" },
      settle_ms = 10000, env = { "WSYNC_GUARD_WATCH=poll" } })
    assert.are.equal(9, result.signal, describe_run(result))
    leftovers.assert_clean(result)
    assert.is_true(result.settled < 10, string.format("the tree ended %.2f s after the host", result.settled))
    assert.matches("is gone; ended the 4 processes it had started", result.stderr)
  end)

  it("ends the tree that a host exiting in order left running, and says so", function()
    local result = leftovers.run({ HOST, "exit" }, { settle_ms = 10000 })
    assert.are.equal(0, result.code, describe_run(result))
    leftovers.assert_clean(result) -- (the host waited for its guard: no zombie either)
    local host = result.stdout:match("ready (%d+)")
    assert.matches("wsync guard: host pid " .. host .. " closed without ending them; ended the 4 processes",
      result.stderr)
    -- The host lives on while its guard works, and removes its own files.
    assert.is_nil(result.stderr:find("removed what they left", 1, true), result.stderr)
  end)

  it("says nothing when its host ended its tree itself", function()
    local result = leftovers.run({ HOST, "clean" }, { settle_ms = 10000 })
    assert.are.equal(0, result.code, describe_run(result))
    leftovers.assert_clean(result)
    assert.are.equal("", result.stderr)
  end)

  it("is started again when it is killed while its host runs", function()
    local result = leftovers.run({ HOST, "kill-guard" }, { signal = { after = "again", name = "sigkill" },
      settle_ms = 10000 })
    local first = result.stdout:match("ready %d+ (%d+)")
    local again = result.stdout:match("again (%d+)")
    assert.is_truthy(again, describe_run(result))
    assert.are_not.equal(first, again)
    assert.matches("wsync guard: the guard %(pid " .. first .. "%) of host pid %d+ exited %(signal 9%) while the "
      .. "host runs; starting another", result.stderr)
    leftovers.assert_clean(result) -- (the second guard ended the tree)
    assert.matches("is gone; ended the 4 processes", result.stderr)
  end)

  it("refuses a command line without its host and mark", function()
    local result = process.wsync({ "guard", "--host", "12" })
    assert.are.equal(2, result.code)
    assert.matches("wsync guard needs %-%-host PID and %-%-mark NAME=VALUE", result.stderr)
  end)
end)
