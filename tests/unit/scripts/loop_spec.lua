-- wsync.loop: coroutines that wait on libuv callbacks, where their errors go,
-- and the orderly close.
local uv = require("luv")
local loop = require("wsync.loop")
local errors = require("wsync.errors")

-- Runs the loop and returns what it raised (nil when nothing).
local function run_and_catch()
  local ok, err = pcall(loop.run)
  if ok then
    return nil
  end
  return err
end

describe("wsync.loop", function()
  after_each(function()
    loop.set_error_handler(nil)
  end)

  it("runs a spawned function until its first await, then on the loop", function()
    local trace = {}
    loop.spawn(function()
      trace[#trace + 1] = "start"
      loop.sleep(5)
      trace[#trace + 1] = "woke"
    end)
    trace[#trace + 1] = "spawned"
    loop.run()
    assert.are.same({ "start", "spawned", "woke" }, trace)
  end)

  it("sleeps at least the asked time, even when the loop's clock is stale", function()
    -- Let time pass without a loop tick, so that the time libuv cached is old.
    local stale_since = uv.hrtime()
    while uv.hrtime() - stale_since < 50e6 do
    end
    local started, finished = uv.hrtime(), nil
    loop.spawn(function()
      loop.sleep(30)
      finished = uv.hrtime()
    end)
    loop.run()
    assert.is_number(finished)
    assert.is_true((finished - started) / 1e6 >= 29, "slept " .. (finished - started) / 1e6 .. " ms")
  end)

  it("returns the callback's values from await, whether it resumes later or at once", function()
    local later, now
    loop.spawn(function()
      later = { loop.await(function(resume)
        local timer = uv.new_timer()
        timer:start(1, 0, function()
          timer:close()
          resume("a", nil, 3)
        end)
      end) }
      now = { loop.await(function(resume)
        resume("immediate")
        resume("ignored second call")
      end) }
    end)
    loop.run()
    assert.are.same({ "a", nil, 3 }, later)
    assert.are.equal(3, table.maxn(later))
    assert.are.same({ "immediate" }, now)
  end)

  it("refuses await outside a spawned coroutine", function()
    assert.has_error(function()
      loop.await(function() end)
    end, "wsync.loop.await needs a coroutine started by wsync.loop.spawn")
    local co = coroutine.create(function()
      loop.await(function() end)
    end)
    local ok, err = coroutine.resume(co)
    assert.is_false(ok)
    assert.matches("needs a coroutine started by wsync.loop.spawn", err, 1, true)
  end)

  it("hands the outcome to on_done", function()
    local outcomes = {}
    loop.spawn(function(a, b)
      loop.sleep(1)
      return a + b, "sum"
    end, function(...)
      outcomes[#outcomes + 1] = { n = select("#", ...), ... }
    end, 2, 3)
    loop.spawn(function()
      loop.sleep(1)
      error("coroutine failed")
    end, function(...)
      outcomes[#outcomes + 1] = { n = select("#", ...), ... }
    end)
    loop.run()
    assert.are.same({ n = 3, true, 5, "sum" }, outcomes[1])
    local ok, err = outcomes[2][1], outcomes[2][2]
    assert.is_false(ok)
    assert.is_true(errors.is(err))
    assert.are.equal("LUA_ERROR", err.code)
    assert.matches("coroutine failed", err.message, 1, true)
    assert.matches("stack traceback", err.traceback, 1, true)
  end)

  it("raises from run what a spawned coroutine threw after an await", function()
    loop.spawn(function()
      loop.sleep(1)
      errors.raise("PUBLISH_FAILED", "late failure", { phase = "chunks" })
    end)
    local err = run_and_catch()
    assert.is_true(errors.is(err))
    assert.are.equal("PUBLISH_FAILED", err.code)
    assert.are.equal("chunks", err.phase)
    assert.is_string(err.traceback)
  end)

  it("raises from run what a spawned coroutine threw before its first await", function()
    loop.spawn(function()
      error("early failure")
    end)
    local err = run_and_catch()
    assert.is_true(errors.is(err), "run raised nothing or a non-error: " .. tostring(err))
    assert.matches("early failure", err.message, 1, true)
    assert.is_nil(run_and_catch(), "the failure was raised twice")
  end)

  it("raises from run an error thrown in a libuv callback, and stops the loop", function()
    local timer = uv.new_timer()
    local later = uv.new_timer()
    local later_fired = false
    timer:start(1, 0, function()
      error("callback failed")
    end)
    later:start(200, 0, function()
      later_fired = true
    end)
    local err = run_and_catch()
    timer:close()
    later:close()
    loop.run()
    assert.matches("callback failed", tostring(err), 1, true)
    assert.is_false(later_fired)
  end)

  it("sends errors to a replaced handler and keeps running", function()
    local seen = {}
    local previous = loop.set_error_handler(function(err)
      seen[#seen + 1] = err
    end)
    assert.is_function(previous)
    loop.spawn(function()
      loop.sleep(1)
      error("first")
    end)
    local survivor_done = false
    loop.spawn(function()
      loop.sleep(10)
      survivor_done = true
    end)
    assert.is_nil(run_and_catch())
    assert.is_true(survivor_done)
    assert.are.equal(1, #seen)
    assert.matches("first", seen[1].message, 1, true)
  end)

  it("annotates errors: wsync errors keep their code, 'interrupted' becomes INTERRUPTED", function()
    local co = coroutine.create(function() end)
    local original = errors.new("X", "m")
    local annotated = loop.annotate(co, original)
    assert.are.equal(original, annotated)
    assert.is_string(annotated.traceback)
    assert.are.equal("INTERRUPTED", loop.annotate(co, "interrupted").code)
    local plain = loop.annotate(co, { not_a_string = true })
    assert.are.equal("LUA_ERROR", plain.code)
  end)

  it("passes the exit sentinel of os.exit through untouched", function()
    local ok, sentinel = pcall(os.exit, 7)
    assert.is_false(ok)
    local co = coroutine.create(function() end)
    assert.are.equal(sentinel, loop.annotate(co, sentinel))
    assert.are.equal(7, sentinel.code)
  end)

  it("close_all closes every handle and drains the loop", function()
    local timer = uv.new_timer()
    local idle = uv.new_idle()
    timer:start(60000, 0, function() end)
    idle:start(function() end)
    assert.is_true(uv.loop_alive())
    loop.close_all()
    assert.is_true(timer:is_closing())
    assert.is_true(idle:is_closing())
    assert.is_false(uv.loop_alive())
  end)

  describe("progress", function()
    local after = loop.PROGRESS_AFTER

    after_each(function()
      loop.PROGRESS_AFTER = after
    end)

    it("calls back once a wait ran PROGRESS_AFTER, then each time it doubled, until cancelled", function()
      loop.PROGRESS_AFTER = 0.02
      local seen = {}
      loop.spawn(function()
        local timer = loop.progress(function(seconds)
          seen[#seen + 1] = seconds
        end)
        loop.sleep(170) -- (20, 40, 80 and 160 ms)
        loop.cancel(timer)
        loop.sleep(200) -- (nothing more: 320 ms would be next)
      end)
      loop.run()
      assert.are.equal(4, #seen, table.concat(seen, ", "))
      for index, seconds in ipairs(seen) do
        local expected = 0.02 * 2 ^ (index - 1)
        assert.is_true(seconds >= expected and seconds < expected + 0.05, string.format("call %d at %.3f s, not %.3f",
          index, seconds, expected))
      end
    end)

    it("never calls back with PROGRESS_AFTER 0, and keeps no loop alive", function()
      loop.PROGRESS_AFTER = 0
      assert.is_nil(loop.progress(error))
      loop.PROGRESS_AFTER = 0.01
      local timer = loop.progress(error)
      loop.run() -- (returns at once: the timer does not keep the loop running)
      assert.is_false(timer:is_closing())
      loop.cancel(timer)
    end)
  end)

  describe("all", function()
    it("runs the tasks at once, returns results by index and the lowest failure", function()
      local results, failed, failure, order = nil, nil, nil, {}
      loop.spawn(function()
        results, failed, failure = loop.all(4, function(i)
          loop.sleep(5 * (4 - i)) -- finish in reverse order
          order[#order + 1] = i
          if i == 2 or i == 3 then
            error("task " .. i .. " failed", 0)
          end
          return i * 10
        end)
      end)
      loop.run()
      assert.are.same({ 4, 3, 2, 1 }, order)
      assert.are.same({ [1] = 10, [4] = 40 }, results)
      assert.are.equal(2, failed)
      assert.matches("task 2 failed", tostring(failure))
    end)

    it("returns at once for no tasks", function()
      local results = nil
      loop.spawn(function()
        results = { loop.all(0, error) }
      end)
      loop.run()
      assert.are.same({ {} }, results)
    end)
  end)

  describe("run_until", function()
    it("runs the loop until the predicate holds, serving unref'd handles too", function()
      uv.update_time() -- timers count from the loop's cached time, stale after a long test
      local keep = uv.new_timer()
      keep:start(60000, 0, function() end)
      local quiet = uv.new_timer()
      quiet:unref()
      local fired = false
      quiet:start(5, 0, function()
        fired = true
      end)
      loop.run_until(function()
        return fired
      end)
      assert.is_true(fired)
      assert.is_true(keep:is_active(), "it returned before the loop ran out of work")
      keep:close()
      quiet:close()
      loop.run()
    end)

    it("returns at once when the predicate holds, without running the loop", function()
      local timer = uv.new_timer()
      local fired = false
      timer:start(0, 0, function()
        fired = true
      end)
      loop.run_until(function()
        return true
      end)
      assert.is_false(fired)
      timer:close()
      loop.run()
    end)

    it("raises LOOP_IDLE when no work is left and the predicate still fails", function()
      local ok, err = pcall(loop.run_until, function()
        return false
      end)
      assert.is_false(ok)
      assert.are.equal("LOOP_IDLE", err.code)
    end)

    it("raises what a callback threw meanwhile, as run does", function()
      local timer = uv.new_timer()
      timer:start(1, 0, function()
        timer:close()
        error("from the timer")
      end)
      local ok, err = pcall(loop.run_until, function()
        return false
      end)
      assert.is_false(ok)
      assert.matches("from the timer", tostring(err))
      loop.run()
    end)

    it("refuses to run inside the loop: from a spawned coroutine or a callback of run", function()
      local from_coroutine, from_callback = nil, nil
      loop.spawn(function()
        from_coroutine = select(2, pcall(loop.run_until, function()
          return true
        end))
      end)
      local timer = uv.new_timer()
      timer:start(1, 0, function()
        timer:close()
        from_callback = select(2, pcall(loop.run_until, function()
          return true
        end))
      end)
      loop.run()
      assert.are.equal("LOOP_BUSY", from_coroutine.code)
      assert.are.equal("LOOP_BUSY", from_callback.code)
    end)
  end)
end)
