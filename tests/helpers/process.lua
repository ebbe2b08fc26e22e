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

--- Runs wsync with `args` and optional stdin; returns the ProcessResult.
function M.wsync(args, stdin, extra)
  local options = { args = args, stdin = stdin }
  for key, value in pairs(extra or {}) do
    options[key] = value
  end
  return M.run(options)
end

return M
