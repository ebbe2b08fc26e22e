--- Test helper: runs the wsync binary (or any program) as a child process with
--- piped stdin, stdout and stderr, and waits for it on the host's loop.
local uv = require("luv")

local M = {}

--- Path of the wsync binary under test: $WSYNC_BIN, or this very process.
function M.wsync_binary()
  return os.getenv("WSYNC_BIN") or uv.exepath()
end

---@class ProcessResult
---@field code integer      exit status (128 + signal when killed)
---@field signal integer    terminating signal, 0 if none
---@field stdout string
---@field stderr string
---@field timed_out boolean

--- Runs `options.args` (a list; the first is the program, default wsync) with
--- `options.stdin` written then closed, `options.env` ({"K=V", ...}, added to
--- the current environment), killed after `options.timeout` ms (default
--- 20000). `options.on_start(process_handle, stdin_pipe, pid, stdout_so_far)`
--- may drive it while it runs (`stdout_so_far()` returns what it printed so
--- far). Returns a ProcessResult.
---@return ProcessResult
function M.run(options)
  local args = options.args or {}
  local program = options.program or M.wsync_binary()
  local stdin = uv.new_pipe(false)
  local stdout = uv.new_pipe(false)
  local stderr = uv.new_pipe(false)
  local output, errors = {}, {}
  local result = { code = -1, signal = 0, timed_out = false }
  local env = nil
  if options.env then
    env = {}
    for key, value in pairs(uv.os_environ()) do
      env[#env + 1] = key .. "=" .. value
    end
    for _, entry in ipairs(options.env) do
      env[#env + 1] = entry
    end
  end
  local handle, pid
  handle, pid = uv.spawn(program, {
    args = args,
    stdio = { stdin, stdout, stderr },
    env = env,
    cwd = options.cwd,
  }, function(code, signal)
    result.code = signal ~= 0 and 128 + signal or code
    result.signal = signal
    handle:close()
  end)
  assert(handle, pid)
  -- libuv times timers from the time cached at the loop's last tick, stale by
  -- however long the test ran without the loop (seconds under valgrind):
  -- refresh it, or the timeout fires early.
  uv.update_time()
  local timer = uv.new_timer()
  timer:start(options.timeout or 20000, 0, function()
    result.timed_out = true
    uv.process_kill(handle, "sigkill")
  end)
  local function collect(sink, pipe)
    pipe:read_start(function(err, data)
      assert(not err, err)
      if data then
        sink[#sink + 1] = data
      else
        pipe:close()
      end
    end)
  end
  collect(output, stdout)
  collect(errors, stderr)
  if options.on_start then
    options.on_start(handle, stdin, pid, function()
      return table.concat(output)
    end)
  else
    if options.stdin then
      stdin:write(options.stdin)
    end
    stdin:shutdown(function()
      stdin:close()
    end)
  end
  -- Run until the child exited and both pipes reached EOF.
  while not (handle:is_closing() and stdout:is_closing() and stderr:is_closing()) do
    uv.run("once")
  end
  timer:stop()
  timer:close()
  if not stdin:is_closing() then
    stdin:close()
  end
  uv.run("nowait")
  result.stdout = table.concat(output)
  result.stderr = table.concat(errors)
  return result
end

---@class StartedProcess
---@field program string
---@field pid integer
---@field handle userdata
---@field stdout string    what it printed so far
---@field stderr string
---@field done boolean     it exited and both pipes ended
---@field code integer?
---@field signal integer?

--- Starts `program` with `args` and the extra `env` entries ("K=V", added to
--- this environment) without waiting for it, collecting its stdout and
--- stderr while the loop runs (see M.drive). No stdin.
---@param program string
---@param args string[]
---@param env string[]?
---@return StartedProcess
function M.start(program, args, env)
  local proc = { program = program, stdout = "", stderr = "", done = false }
  local environment = {}
  for key, value in pairs(uv.os_environ()) do
    environment[#environment + 1] = key .. "=" .. value
  end
  for _, entry in ipairs(env or {}) do
    environment[#environment + 1] = entry
  end
  local pipes = { stdout = uv.new_pipe(false), stderr = uv.new_pipe(false) }
  local open = 3
  local function ended()
    open = open - 1
    proc.done = open == 0
  end
  local handle, pid = uv.spawn(program, { args = args, env = environment, stdio = { nil, pipes.stdout, pipes.stderr } },
    function(code, signal)
      proc.code, proc.signal = code, signal
      proc.handle:close()
      ended()
    end)
  if not handle then
    pipes.stdout:close()
    pipes.stderr:close()
    error("cannot start " .. program .. ": " .. tostring(pid))
  end
  proc.handle, proc.pid = handle, pid
  for key, pipe in pairs(pipes) do
    pipe:read_start(function(read_error, data)
      assert(not read_error, read_error)
      if data then
        proc[key] = proc[key] .. data
      else
        pipe:close()
        ended()
      end
    end)
  end
  return proc
end

--- Runs the loop until `predicate()` holds; fails naming `what` after `ms`
--- milliseconds.
---@param predicate fun(): boolean
---@param ms integer
---@param what string
function M.drive(predicate, ms, what)
  local expired = false
  uv.update_time() -- (as in M.run)
  local timer = uv.new_timer()
  timer:start(ms, 0, function()
    expired = true
  end)
  while not predicate() and not expired do
    uv.run("once")
  end
  timer:close()
  uv.run("nowait")
  assert(not expired, string.format("timed out after %d ms waiting for %s", ms, what))
end

--- Runs `fn` in a coroutine of wsync.loop (it may wait on the loop) while
--- the loop drives the started processes too, for at most `ms` milliseconds
--- (default 60000); returns what it returned, raises what it raised.
---@param fn function
---@param ms integer?
function M.in_coroutine(fn, ms)
  local outcome = nil
  require("wsync.loop").spawn(fn, function(...)
    outcome = { ... }
  end)
  M.drive(function()
    return outcome ~= nil
  end, ms or 60000, "the test's coroutine")
  if not outcome[1] then
    error(outcome[2], 0)
  end
  return unpack(outcome, 2)
end

--- Kills `proc` (SIGKILL) unless it is done, and waits until it is.
---@param proc StartedProcess
function M.finish(proc)
  if not proc.done then
    if not proc.handle:is_closing() then
      proc.handle:kill("sigkill")
    end
    M.drive(function()
      return proc.done
    end, 5000, "a killed process")
  end
end

--- Runs wsync with `args` and optional stdin; returns the ProcessResult.
function M.wsync(args, stdin, extra)
  local options = { args = args, stdin = stdin }
  for key, value in pairs(extra or {}) do
    options[key] = value
  end
  return M.run(options)
end

return M
