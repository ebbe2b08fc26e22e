-- wsync.publish.trainers: trainer processes (here `sh -c` stand-ins)
-- spawned one per rank, their exits recorded and said, stopped at the
-- session's end (a moment, then SIGKILL) or killed at once for an abort, and
-- what the closing report and the verdict say of them.
local async = require("tests.helpers.async")
local loop = require("wsync.loop")
local trainers_module = require("wsync.publish.trainers")
local captured = require("tests.helpers.stdout").captured
local error_of = require("tests.helpers.errors").error_of

-- Rank r runs `sh -c scripts[r + 1]`.
local function shell(scripts)
  return function(rank)
    return { program = "sh", args = { "-c", scripts[rank + 1] } }
  end
end

-- A session as the trainers see it, in `phase`.
local function session_in(phase)
  return { condition = loop.condition(), phase = phase }
end

-- Waits (in a coroutine) until every rank of `trainers` exited.
local function await_exits(session, trainers, world)
  assert(session.condition:wait_for(10, function()
    for rank = 0, world - 1 do
      if not trainers:exit_of(rank) then
        return false
      end
    end
    return true
  end), "the trainer processes did not exit")
end

describe("wsync.publish.trainers", function()
  local saved_grace
  before_each(function()
    saved_grace = trainers_module.EXIT_GRACE
  end)
  after_each(function()
    trainers_module.EXIT_GRACE = saved_grace
  end)

  it("describes an exit by its signal, else its code", function()
    assert.are.equal("code 0", trainers_module.describe_exit(0, 0))
    assert.are.equal("code 3", trainers_module.describe_exit(3, 0))
    assert.are.equal("signal 9", trainers_module.describe_exit(0, 9))
  end)

  it("records each rank's exit, says at once one that failed before the session did, and names it", function()
    local session = session_in("registration")
    local trainers = trainers_module.new(session)
    local pids
    local said = captured(async.run_async, function()
      trainers:spawn(2, shell({ "exit 0", "exit 3" }))
      pids = trainers:pids()
      assert.is_true(trainers:spawned(0) and trainers:spawned(1))
      assert.is_false(trainers:spawned(2))
      await_exits(session, trainers, 2)
    end)
    local pid_of_rank_1 = said:match("^wsync: synthetic trainer rank 1 %(pid (%d+)%) exited %(code 3%) during "
      .. "registration\n$")
    assert.is_string(pid_of_rank_1, said)
    assert.is_true(pids[tonumber(pid_of_rank_1)])
    assert.is_true(trainers:any_exited())
    assert.are.same({ code = 3, signal = 0 }, trainers:exit_of(1))
    assert.are.equal("code 0", trainers:describe(0))
    assert.is_nil(trainers:describe(2))
    assert.are.equal("rank 0 exited with code 0, rank 1 exited with code 3", trainers:ends())
    local failure = trainers:failure(5)
    assert.are.equal("TRAINER_FAILED", failure.code)
    assert.are.equal(1, failure.rank)
    assert.are.equal("synthetic trainer rank 1 exited with code 3", failure.message)
  end)

  it("does not say an exit once the session stopped or is closing, unless a signal the host did not send", function()
    local session = session_in("ending")
    session.stopped = "a failure"
    local trainers = trainers_module.new(session)
    local said = captured(async.run_async, function()
      trainers:spawn(2, shell({ "exit 1", "kill -TERM $$" }))
      await_exits(session, trainers, 2)
    end)
    assert.matches("^wsync: synthetic trainer rank 1 %(pid %d+%) exited %(signal 15%) during ending\n$", said)
    assert.are.equal("rank 0 exited with code 1, rank 1 ended by signal 15", trainers:ends())
  end)

  it("has nothing to say without processes (external ranks)", function()
    local trainers = trainers_module.new(session_in("ready"))
    assert.is_false(trainers:any_exited())
    assert.is_nil(trainers:ends())
    assert.is_nil(trainers:failure(5))
    assert.is_nil(trainers:exit_of(0))
    async.run_async(function()
      assert.is_nil(trainers:stop(true, function()
        return false
      end))
    end)
  end)

  it("refuses a rank that cannot start, naming it", function()
    local trainers = trainers_module.new(session_in("listen"))
    local err = error_of(trainers.spawn, trainers, 1, function()
      return { program = "/nonexistent/wsync-trainer", args = {} }
    end)
    assert.are.equal("TRAINER_START", err.code)
    assert.matches("^cannot start synthetic trainer rank 0: ENOENT", err.message)
  end)

  it("stops at the end: a moment to exit, then SIGKILL for those still running, said", function()
    trainers_module.EXIT_GRACE = 0.2
    local session = session_in("closing")
    local trainers = trainers_module.new(session)
    local seconds
    local said = captured(async.run_async, function()
      trainers:spawn(2, shell({ "sleep 0.05", "exec sleep 30" }))
      seconds = trainers:stop(true, function()
        return false
      end)
    end)
    assert.matches("^wsync: trainer rank 1 %(pid %d+%) did not exit: killed\n$", said)
    assert.is_true(seconds >= 0.2, "it did not wait the moment")
    assert.are.equal("rank 0 exited with code 0, rank 1 killed", trainers:ends())
    assert.are.same({ code = 0, signal = 9 }, trainers:exit_of(1))
  end)

  it("gives a spared rank no moment, and waits for none when not patient", function()
    trainers_module.EXIT_GRACE = 5
    for _, case in ipairs({ { patient = true, spared = true }, { patient = false, spared = false } }) do
      local trainers = trainers_module.new(session_in("closing"))
      local started = os.time()
      captured(async.run_async, function()
        trainers:spawn(1, shell({ "exec sleep 30" }))
        trainers:stop(case.patient, function()
          return case.spared
        end)
      end)
      assert.is_true(os.time() - started < 4, "it waited for the rank")
      assert.are.equal("rank 0 killed", trainers:ends())
    end
  end)

  it("kills every process at once for an abort, and waits until they are gone", function()
    local session = session_in("publish")
    local trainers = trainers_module.new(session)
    async.run_async(function()
      trainers:spawn(2, shell({ "exec sleep 30", "exec sleep 31" }))
      trainers:kill_now()
      for pid in pairs(trainers:pids()) do
        local stat = require("wsync.util").read_file("/proc/" .. pid .. "/stat") or ""
        assert.is_true(stat == "" or stat:match("%) Z ") ~= nil, "pid " .. pid .. " still runs")
      end
      captured(await_exits, session, trainers, 2)
    end)
    assert.are.same({ code = 0, signal = 9 }, trainers:exit_of(0))
  end)

  describe("synthetic", function()
    local saved_guard
    before_each(function()
      saved_guard = package.loaded["wsync.control.guard"]
      package.loaded["wsync.control.guard"] = { environment = function()
        return "WSYNC_GUARD_MARK=spec"
      end }
    end)
    after_each(function()
      package.loaded["wsync.control.guard"] = saved_guard
    end)

    it("starts `wsync trainer` for the rank, marked for the guard", function()
      local recipe = { backend = "host", model = { preset = "tiny" }, trainer = { steps = 3 } }
      local command = trainers_module.synthetic(recipe, "/tmp/control.sock", 2)(1)
      assert.are.equal(require("wsync.util").program(), command.program)
      assert.are.same({ "trainer", "--endpoint", "/tmp/control.sock", "--rank", "1", "--world", "2", "--model",
        "tiny", "--versions", "3", "--backend", "host", "--storage", "one" }, command.args)
      local marked = false
      for _, entry in ipairs(command.env) do
        marked = marked or entry == "WSYNC_GUARD_MARK=spec"
      end
      assert.is_true(marked)
      recipe.model = { config = { hidden_size = 8 } }
      recipe.trainer.storage = "tensor"
      local args = trainers_module.synthetic(recipe, "/tmp/control.sock", 2)(0).args
      assert.are.equal('{"hidden_size":8}', args[9])
      assert.are.equal("tensor", args[#args])
    end)
  end)
end)
