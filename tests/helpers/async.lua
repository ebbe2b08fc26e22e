--- Test helper: runs code that waits on the loop (a runtime client, a
--- channel) inside a coroutine, the way wsync itself runs it, and hands its
--- error back to busted.
local uv = require("luv")
local loop = require("wsync.loop")

local M = {}

--- How long `run_async` lets its function run before it gives up, in ms.
M.DEFAULT_TIMEOUT_MS = 30000

--- Runs `fn(...)` in a coroutine started by wsync.loop.spawn, then runs the
--- loop until no work is left. Re-raises what `fn` raised (so busted reports
--- the test's own failure, traceback included). When `fn` fails, or has not
--- finished after `timeout_ms`, the loop is stopped without waiting for the
--- handles it left; the test's cleanup must end them.
---@param fn function
---@param timeout_ms integer?
function M.run_async(fn, timeout_ms, ...)
  local finished, ok, failure = false, nil, nil
  uv.update_time() -- (the cached loop time is stale by what ran without the loop)
  local watchdog = uv.new_timer()
  watchdog:start(timeout_ms or M.DEFAULT_TIMEOUT_MS, 0, function()
    if not finished then
      finished, ok = true, false
      failure = string.format("run_async: not finished after %d ms", timeout_ms or M.DEFAULT_TIMEOUT_MS)
      uv.stop()
    end
  end)
  watchdog:unref() -- the watchdog alone does not keep the loop running
  -- The error is caught inside the coroutine, before wsync.loop wraps it, so
  -- that busted sees luassert's failures as failures; a string error gets
  -- the coroutine's traceback appended.
  local function catch(err)
    if type(err) == "string" then
      return debug.traceback(err, 2)
    end
    return err
  end
  loop.spawn(function(...)
    local success, err = xpcall(fn, catch, ...)
    if finished then
      return -- it ended after the watchdog fired: too late to count
    end
    finished, ok, failure = true, success, err
    if not success then
      uv.stop()
    end
  end, nil, ...)
  local ran, loop_error = pcall(loop.run)
  watchdog:close()
  uv.run("nowait") -- completes the watchdog's close
  if not ran then
    error(loop_error, 0)
  end
  if not finished then
    error("run_async: the loop ran out of work while the function still waited", 0)
  end
  if not ok then
    error(failure, 0)
  end
end

--- Starts `fn(...)` in another coroutine and returns a function that waits
--- (inside a coroutine) until it ended and returns its ok flag and results, as
--- pcall would.
---@param fn function
---@return fun(): boolean, ...
function M.start(fn, ...)
  local outcome, waiter = nil, nil
  loop.spawn(fn, function(...)
    outcome = { n = select("#", ...), ... }
    if waiter then
      waiter()
    end
  end, ...)
  return function()
    if not outcome then
      loop.await(function(resume)
        waiter = resume
      end)
    end
    return unpack(outcome, 1, outcome.n)
  end
end

return M
