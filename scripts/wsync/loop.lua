--- The host's libuv loop as wsync uses it: coroutines that wait on callbacks,
--- one place where callback errors land, and an orderly close.
---
--- Code that waits (a response, a child's exit) runs in a coroutine started
--- with `spawn` and calls `await`; `run` drives the loop until no work is left
--- and raises the first error a callback or a spawned coroutine threw.
local uv = require("luv")
local host = require("wsync._host")
local errors = require("wsync.errors")

local M = {}

local pack = require("wsync.util").pack

local first_failure = nil
local kept = setmetatable({}, { __mode = "k" }) -- handles kept for the host's lifetime
local close_hooks = {}                           -- run first by close_all

local function default_report(err)
  if first_failure == nil then
    first_failure = err
  end
  uv.stop()
end

local report = default_report

host.set_callback_error_handler(function(err)
  report(err)
end)

--- Replaces the handler of errors thrown in callbacks and spawned coroutines
--- (the REPL prints them and goes on). Returns the previous handler; pass nil
--- to restore the default, which records the first error and stops the loop.
---@param handler fun(err: any)?
---@return fun(err: any)
function M.set_error_handler(handler)
  local previous = report
  report = handler or default_report
  return previous
end

local resume_hooks = setmetatable({}, { __mode = "k" })
local steps = setmetatable({}, { __mode = "k" }) -- coroutine -> its resume step
local running = false -- inside run or run_until: libuv's loop is not reentrant

-- Hands back (and forgets) the first error reported since the last run.
local function take_failure()
  local failure = first_failure
  first_failure = nil
  return failure
end

--- Runs the loop until no handle or request is active. Raises the first error
--- reported since the last run: while it ran, or before it (a spawned
--- coroutine that fails before its first await).
function M.run()
  local was_running = running
  running = true
  local ran, err = pcall(uv.run, "default")
  running = was_running
  if not ran then
    error(err, 0)
  end
  local failure = take_failure()
  if failure ~= nil then
    error(failure, 0)
  end
end

--- True inside `run` or `run_until` (in a callback they run) and in a
--- coroutine started by `spawn`: code there may not run the loop itself.
---@return boolean
function M.is_running()
  local co = coroutine.running()
  return running or (co ~= nil and steps[co] ~= nil)
end

--- Runs the loop one iteration at a time until `predicate()` holds: for code
--- outside the loop that waits synchronously (libwsync's agent calls). Raises
--- the first error reported meanwhile, as `run` does; LOOP_IDLE when no work
--- is left and the predicate still fails; LOOP_BUSY when called while the loop
--- runs (from a callback or a spawned coroutine: libuv's loop is not
--- reentrant). Handles that were unref'd keep being served while it runs.
---@param predicate fun(): boolean
function M.run_until(predicate)
  if M.is_running() then
    errors.raise("LOOP_BUSY", "wsync.loop.run_until called while the loop runs (from a callback or a coroutine)")
  end
  running = true
  local ok, err = pcall(function()
    while first_failure == nil and not predicate() do
      if not uv.loop_alive() then
        errors.raise("LOOP_IDLE", "the loop has no work left and what it waits for has not happened")
      end
      uv.run("once")
    end
  end)
  running = false
  local failure = take_failure()
  if failure ~= nil then
    error(failure, 0)
  end
  if not ok then
    error(err, 0)
  end
end

--- Calls `before()` and `after()` around every later resume of `co`, a
--- coroutine started by `spawn` (the REPL arms Ctrl-C around the resumes of
--- the chunk it runs). Neither may raise. `before` nil removes them.
---@param co thread
---@param before fun()?
---@param after fun()?
function M.set_resume_hooks(co, before, after)
  resume_hooks[co] = before and { before = before, after = after } or nil
end

--- Starts `fn(...)` in a coroutine now; it runs until its first `await`.
--- Errors inside it are reported like callback errors. `on_done(ok, ...)`,
--- when given, receives its outcome instead.
---@param fn function
---@param on_done fun(ok: boolean, ...)?
---@return thread
function M.spawn(fn, on_done, ...)
  local co = coroutine.create(fn)
  local function step(...)
    local hooks = resume_hooks[co]
    if hooks then hooks.before() end
    local results = pack(coroutine.resume(co, ...))
    if hooks then hooks.after() end
    if not results[1] then
      results[2] = M.annotate(co, results[2])
    end
    if coroutine.status(co) == "dead" then
      -- LuaJIT's weak tables are not ephemerons: `step` refers to `co`, so
      -- the entry would keep its own key alive forever. Dead: forget it.
      steps[co], resume_hooks[co] = nil, nil
      if on_done then
        on_done(unpack(results, 1, results.n))
      elseif not results[1] then
        report(results[2])
      end
    end
  end
  steps[co] = step
  step(...)
  return co
end

--- Turns what a coroutine died with into an error object carrying the
--- coroutine's traceback: a wsync error keeps its code, a plain Lua error
--- becomes LUA_ERROR ("interrupted" becomes INTERRUPTED). The exit sentinel
--- that os.exit raises passes untouched, so that it still ends the process.
---@param co thread
---@param err any
---@return wsync.Error
function M.annotate(co, err)
  if errors.is_exit(err) then
    return err
  end
  if errors.is(err) then
    err.traceback = err.traceback or debug.traceback(co)
    return err
  end
  local message = type(err) == "string" and err or tostring(err)
  local code = message:match("^interrupted") and "INTERRUPTED" or "LUA_ERROR"
  return errors.new(code, message, { traceback = debug.traceback(co) })
end

--- Suspends the running coroutine until the callback handed to `start` is
--- called; returns that callback's arguments. `start(resume)` must arrange for
--- `resume(...)` to be called exactly once, from a libuv callback.
---@param start fun(resume: fun(...))
function M.await(start)
  local co = coroutine.running()
  local step = co and steps[co]
  if not step then
    error("wsync.loop.await needs a coroutine started by wsync.loop.spawn", 2)
  end
  local resumed, results = false, nil
  local waiting = false
  start(function(...)
    if resumed then return end
    resumed = true
    if waiting then
      step(...)
    else
      results = { n = select("#", ...), ... }
    end
  end)
  if resumed then
    return unpack(results, 1, results.n)
  end
  waiting = true
  return coroutine.yield()
end

--- Runs `task(i)` for i = 1..count at once, each in its own coroutine, and
--- waits (inside a spawned coroutine) until all have finished. Returns the
--- results by i and, when some failed, the lowest failing i and its error.
---@param count integer
---@param task fun(i: integer): any
---@return table results, integer? failed_index, any failure
function M.all(count, task)
  local results, failed_index, failure, remaining = {}, nil, nil, count
  if count == 0 then
    return results
  end
  M.await(function(resume)
    for i = 1, count do
      M.spawn(function()
        return task(i)
      end, function(ok, value)
        if ok then
          results[i] = value
        elseif failed_index == nil or i < failed_index then
          failed_index, failure = i, value
        end
        remaining = remaining - 1
        if remaining == 0 then
          resume()
        end
      end)
    end
  end)
  return results, failed_index, failure
end

--- Calls `fn()` once, `ms` milliseconds from now (from a libuv callback: it
--- must not raise). Returns the timer; `M.cancel(timer)` stops it first.
---@param ms number
---@param fn fun()
---@return userdata
function M.after(ms, fn)
  -- libuv times timers from the time cached at the last loop tick, which is
  -- stale when this runs outside the loop (before run): refresh it.
  uv.update_time()
  local timer = uv.new_timer()
  timer:start(math.max(0, math.floor(ms)), 0, function()
    timer:close()
    fn()
  end)
  return timer
end

--- Calls `fn()` every `ms` milliseconds (from a libuv callback: it must not
--- raise) until `M.cancel(timer)`. The timer does not keep the loop alive: it
--- watches work that does (a call waiting in `run_until`).
---@param ms number
---@param fn fun()
---@return userdata
function M.every(ms, fn)
  uv.update_time()
  local timer = uv.new_timer()
  local period = math.max(1, math.floor(ms))
  timer:start(period, period, fn)
  timer:unref()
  return timer
end

--- How long a wait runs before it says what it waits for, in seconds
--- ($WSYNC_PROGRESS_AFTER; default 5, 0 never): then again each time its
--- length doubled (M.progress).
M.PROGRESS_AFTER = tonumber(os.getenv("WSYNC_PROGRESS_AFTER")) or 5

--- Calls `fn(seconds)` once a wait that starts now has run M.PROGRESS_AFTER
--- seconds, then each time its length doubled (5, 10, 20, 40 s...), with the
--- seconds it has run, until `M.cancel(timer)`. From a libuv callback: `fn`
--- must not raise. The timer does not keep the loop alive: it watches work
--- that does. Returns the timer (nil when M.PROGRESS_AFTER is 0).
---@param fn fun(seconds: number)
---@return userdata?
function M.progress(fn)
  if M.PROGRESS_AFTER <= 0 then
    return nil
  end
  uv.update_time()
  local started, next_at = uv.now(), M.PROGRESS_AFTER * 1000
  local timer = uv.new_timer()
  local function arm()
    timer:start(math.max(0, math.floor(next_at - (uv.now() - started))), 0, function()
      next_at = next_at * 2
      arm()
      fn((uv.now() - started) / 1000)
    end)
  end
  arm()
  timer:unref()
  return timer
end

--- Stops and closes a timer from M.after or M.every (or any handle) unless it
--- already closed. Safe to call twice, and with nil.
---@param timer userdata?
function M.cancel(timer)
  if timer and not timer:is_closing() then
    timer:close()
  end
end

--- Waits at least `ms` milliseconds inside a spawned coroutine.
---@param ms integer
function M.sleep(ms)
  M.await(function(resume)
    M.after(ms, resume)
  end)
end

---@class wsync.Condition
local Condition = {}
Condition.__index = Condition

--- A condition: `wait(predicate)` suspends the running coroutine (of
--- M.spawn) until `predicate()` holds, checked again at every `notify()`.
---@return wsync.Condition
function M.condition()
  return setmetatable({ waiters = {} }, Condition)
end

--- Waits until `predicate()` holds.
---@param predicate fun(): boolean
function Condition:wait(predicate)
  while not predicate() do
    M.await(function(resume)
      self.waiters[#self.waiters + 1] = resume
    end)
  end
end

--- Waits until `predicate()` holds or `seconds` have passed; returns whether
--- it holds.
---@param seconds number
---@param predicate fun(): boolean
---@return boolean
function Condition:wait_for(seconds, predicate)
  local expired = false
  local timer = M.after(seconds * 1000, function()
    expired = true
    self:notify()
  end)
  self:wait(function()
    return expired or predicate()
  end)
  M.cancel(timer)
  return predicate() and true or false
end

--- Wakes every waiter to check its predicate again.
function Condition:notify()
  local waiters = self.waiters
  self.waiters = {}
  for _, resume in ipairs(waiters) do
    resume()
  end
end

local spin_handle, spin_deadline = nil, 0

--- Whether this machine has cores to spare for polling without sleeping
--- (M.spin): 8 or more. A publication keeps the host, the trainer ranks, the
--- runtime's main process and its TP workers busy at once; on fewer cores a
--- process that polls takes the core another one needs to answer it
--- (measured on 2 CPUs: a TP2 publication of 18,867 tensors spent several
--- milliseconds in the other processes' polling windows).
M.SPARE_CORES = #(uv.cpu_info() or {}) >= 8

--- Keeps the loop polling without sleeping for the next `microseconds`
--- (extending a window already running). A process that expects an answer
--- within microseconds calls this so that the answer is not delayed by the
--- kernel waking an idle CPU (about 90 us on a virtual machine, against 10 us
--- when awake). The cost is one busy core for at most the window.
---@param microseconds number
function M.spin(microseconds)
  local deadline = uv.hrtime() + microseconds * 1000
  if deadline > spin_deadline then
    spin_deadline = deadline
  end
  if spin_handle == nil or spin_handle:is_closing() then
    spin_handle = uv.new_idle()
  end
  if not spin_handle:is_active() then
    spin_handle:start(function()
      if uv.hrtime() >= spin_deadline then
        spin_handle:stop()
      end
    end)
  end
end

--- Whether `handle` is one this module keeps for itself from call to call
--- (the spin window's idle handle, active for at most a window after a
--- request): a check for handles a caller left behind does not count it.
---@param handle userdata
---@return boolean
function M.owns(handle)
  return handle == spin_handle or kept[handle] == true
end

--- Marks `handle` as one kept for the host's lifetime (the guard's process
--- and pipe, wsync.control.guard): `owns` counts it, and it is closed by the
--- hook that opened it (`at_close`) or by close_all.
---@param handle userdata
function M.keep(handle)
  kept[handle] = true
end

--- Runs `fn()` once, first thing in close_all (before any handle closes), in
--- the order registered: what must end in order while the loop still runs
--- (the guard waits there for its process). `fn` must not raise.
---@param fn fun()
function M.at_close(fn)
  close_hooks[#close_hooks + 1] = fn
end

--- Closes every open handle and runs the loop until the closes complete. The
--- host calls this before it closes the Lua state.
function M.close_all()
  local hooks = close_hooks
  close_hooks = {}
  for _, fn in ipairs(hooks) do
    local ok, err = pcall(fn)
    if not ok then
      io.stderr:write("wsync: closing: " .. tostring(err) .. "\n")
    end
  end
  uv.walk(function(handle)
    if not handle:is_closing() then
      handle:close()
    end
  end)
  uv.run("default")
end

return M
