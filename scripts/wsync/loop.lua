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

local first_failure = nil

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

--- Runs the loop until no handle or request is active. Raises the first error
--- reported while it ran.
function M.run()
  first_failure = nil
  uv.run("default")
  local failure = first_failure
  first_failure = nil
  if failure ~= nil then
    error(failure, 0)
  end
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
    local results = { coroutine.resume(co, ...) }
    if not results[1] then
      results[2] = M.annotate(co, results[2])
    end
    if coroutine.status(co) == "dead" then
      if on_done then
        on_done(unpack(results, 1, table.maxn(results)))
      elseif not results[1] then
        report(results[2])
      end
    end
  end
  M._steps = M._steps or setmetatable({}, { __mode = "k" })
  M._steps[co] = step
  step(...)
  return co
end

--- Turns what a coroutine died with into an error object carrying the
--- coroutine's traceback: a wsync error keeps its code, a plain Lua error
--- becomes LUA_ERROR ("interrupted" becomes INTERRUPTED).
---@param co thread
---@param err any
---@return wsync.Error
function M.annotate(co, err)
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
  local step = co and M._steps and M._steps[co]
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

--- Waits `ms` milliseconds inside a spawned coroutine.
---@param ms integer
function M.sleep(ms)
  M.await(function(resume)
    local timer = uv.new_timer()
    timer:start(ms, 0, function()
      timer:close()
      resume()
    end)
  end)
end

--- Closes every open handle and runs the loop until the closes complete. The
--- host calls this before it closes the Lua state.
function M.close_all()
  uv.walk(function(handle)
    if not handle:is_closing() then
      handle:close()
    end
  end)
  uv.run("default")
end

return M
