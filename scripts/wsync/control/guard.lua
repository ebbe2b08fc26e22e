--- The guard: a small process (`wsync guard`) that ends what a host started
--- once that host is gone, however it went, SIGKILL included, with no code of
--- the dying host running.
---
--- A host starts its guard before the first process it must not outlive (a
--- rollout runtime, a synthetic trainer rank) and hands each of those a mark
--- in its environment, `WSYNC_GUARD_MARK=<host pid>-<random>`, which every
--- process they start inherits: vLLM's EngineCore and TP workers, the
--- reference runtime's workers, whatever process group or session they move
--- to. The guard is the host's child in a session of its own (a signal to the
--- host's process group or terminal does not reach it) and watches two
--- things: the host's exit, through a pidfd (immune to pid reuse and to a
--- descriptor that a fork of the host kept), and its stdin, a pipe whose
--- other end only the host holds, which closes when the host's descriptors
--- do (the host standing down says so first). When either fires, it sends SIGTERM to every
--- process carrying the mark, SIGKILL to those still there after the grace
--- period, and, when the host died, removes what the host and the processes it
--- ended left in /dev/shm and $TMPDIR. A host that closes cleanly closes the
--- pipe after its runtimes ended and reaps the guard, which then finds
--- nothing to end and exits at once.
local uv = require("luv")
local errors = require("wsync.errors")
local loop = require("wsync.loop")
local process = require("wsync._process")

local M = {}

--- The environment variable of the mark.
M.VARIABLE = "WSYNC_GUARD_MARK"

--- How long the guard waits after SIGTERM before SIGKILL, in ms.
M.GRACE_MS = 3000

--- How long the guard keeps sending SIGKILL to processes that do not go (one
--- stuck in the kernel, in a device driver) before it reports them and exits.
M.GIVE_UP_MS = 30000

--- How often the guard looks for marked processes while they go, in ms.
M.POLL_MS = 20

--- What a host that closes in order writes to its guard before it closes the
--- pipe: the pipe's end alone means the host is exiting.
M.STAND_DOWN = "stand down\n"

-- This host's guard: {entry, handle, pid, stdin, started, stopping}.
local guard = nil
-- The sessions the guard ends too ({[sid] = true}): the runtimes' own.
local watched = {}

local function say(format, ...)
  io.stderr:write("wsync guard: " .. string.format(format, ...) .. "\n")
  io.stderr:flush()
end

-- Tells the guard a line, when it runs.
local function tell(line)
  if guard and not guard.stdin:is_closing() then
    guard.stdin:try_write(line)
  end
end

local start

-- The guard `ended` exited: reaped by the host's stop, or it ended while its
-- host still needed it (killed by hand, or it failed): then another starts,
-- unless this one did not even live a second (the next process that needs
-- one starts it).
local function on_exit(ended, code, signal)
  ended.exited = true
  if not ended.handle:is_closing() then
    ended.handle:close()
  end
  if not ended.stdin:is_closing() then
    ended.stdin:close()
  end
  if ended.stopping or guard ~= ended then
    return
  end
  guard = nil
  local lived = uv.now() - ended.started
  say("the guard (pid %d) of host pid %d exited (%s) while the host runs; %s", ended.pid, uv.os_getpid(),
    signal ~= 0 and ("signal " .. signal) or ("code " .. code), lived >= 1000 and "starting another"
    or "another starts with the next process that needs one")
  if lived >= 1000 then
    local ok, err = pcall(start, ended.entry)
    if not ok then
      say("cannot start another guard: %s", tostring(err))
    end
  end
end

function start(entry)
  local program = require("wsync.util").program()
  local record = { entry = entry, stdin = uv.new_pipe(false), started = uv.now() }
  local handle, pid = uv.spawn(program, {
    args = { "guard", "--host", tostring(uv.os_getpid()), "--mark", entry, "--grace-ms", tostring(M.GRACE_MS) },
    stdio = { record.stdin, nil, 2 },
    detached = true,
  }, function(code, signal)
    on_exit(record, code, signal)
  end)
  if not handle then
    record.stdin:close()
    errors.raise("GUARD_START", string.format("cannot start the guard that ends this host's runtime if the host dies "
      .. "(%s guard): %s", program, tostring(pid)))
  end
  record.handle, record.pid = handle, pid
  -- (Neither keeps the loop running: the guard lives as long as the host.)
  handle:unref()
  record.stdin:unref()
  loop.keep(handle)
  loop.keep(record.stdin)
  guard = record
  for session in pairs(watched) do
    tell(string.format("watch %d\n", session))
  end
  return record
end

--- Puts session `session` in the guard's care too: a process tree that
--- spawned detached (its first process leads the session) is then ended as a
--- whole, also the members whose environment no longer shows the mark
--- (vLLM's EngineCore writes its title over it: setproctitle). Call
--- `unwatch` once the tree is gone, before its pid can be reused.
---@param session integer
function M.watch(session)
  watched[session] = true
  tell(string.format("watch %d\n", session))
end

--- Takes session `session` out of the guard's care (its tree ended).
---@param session integer
function M.unwatch(session)
  if watched[session] then
    watched[session] = nil
    tell(string.format("unwatch %d\n", session))
  end
end

--- The `NAME=VALUE` entry that puts a process in this host's guard's care,
--- for the environment of a process the host spawns; starts the guard first
--- when it does not run. Raises GUARD_START or PROGRAM_NOT_FOUND when it
--- cannot start.
---@return string
function M.environment()
  if not guard then
    start(string.format("%s=%d-%s", M.VARIABLE, uv.os_getpid(), require("wsync.util").random_hex(16)))
    loop.at_close(M.stop)
  end
  return guard.entry
end

--- The guard's pid, or nil when this host runs none.
---@return integer?
function M.pid()
  return guard and guard.pid
end

--- Stops this host's guard in order (the host closes): tells it so and
--- closes its pipe, so that it ends whatever still carries the mark, and
--- waits until it exited and reaps it, without running the loop (no other
--- callback runs while the host closes). Called by wsync.loop.close_all.
function M.stop()
  local stopping = guard
  guard = nil
  if not stopping or stopping.exited then
    return
  end
  stopping.stopping = true
  if not stopping.stdin:is_closing() then
    stopping.stdin:try_write(M.STAND_DOWN)
    stopping.stdin:close()
  end
  -- (libuv no longer reaps it once its handle closes: the guard is the
  -- leader of its own group, which reap_group waits for.)
  if not stopping.handle:is_closing() then
    stopping.handle:close()
  end
  -- It ends marked processes first: at most the grace period and a kill.
  local deadline = uv.hrtime() + (M.GRACE_MS + 2000) * 1e6
  while (process.reap_group(stopping.pid) or 0) == 0 and select(3, uv.kill(-stopping.pid, 0)) ~= "ESRCH" do
    if uv.hrtime() > deadline then
      uv.kill(stopping.pid, "sigkill")
      deadline = math.huge
    end
    uv.sleep(2)
  end
  stopping.exited = true
end

--- Ends every process other than this one that carries `entry` in its
--- environment or belongs to one of `options.sessions`: SIGTERM at once (and to each that appears later), SIGKILL
--- after `grace_ms`, again at every look until none is left or `give_up_ms`
--- passed. Must run in a coroutine. Returns what it did: `terminated` and
--- `killed` (pids, sorted), `left` (those still there when it gave up).
---@param entry string
---@param options {grace_ms: integer?, give_up_ms: integer?, sessions: integer[]?}?
---@return {terminated: integer[], killed: integer[], left: integer[]}
function M.sweep(entry, options)
  options = options or {}
  local sessions = options.sessions or {}
  local grace_ms = options.grace_ms or M.GRACE_MS
  local give_up_ms = options.give_up_ms or M.GIVE_UP_MS
  local started = uv.now()
  local terminated, killed, left = {}, {}, {}
  while true do
    uv.update_time()
    local pids = assert(process.find_marked(entry, sessions))
    if #pids == 0 then
      break
    end
    local elapsed = uv.now() - started
    if elapsed >= give_up_ms then
      left = pids
      break
    end
    for _, pid in ipairs(pids) do
      if not terminated[pid] then
        terminated[pid] = true
        uv.kill(pid, "sigterm")
      end
      if elapsed >= grace_ms then
        killed[pid] = true
        uv.kill(pid, "sigkill")
      end
    end
    loop.sleep(M.POLL_MS)
  end
  table.sort(left)
  local util = require("wsync.util")
  return { terminated = util.sorted_keys(terminated), killed = util.sorted_keys(killed), left = left }
end

--- Removes what processes `pids` ({[pid] = true}) left named for themselves:
--- /dev/shm segments (`wsync-<pid>-...`) and control directories in
--- `parent` (`wsync-<pid>-XXXXXX` with their socket). Returns the paths
--- removed.
---@param pids table<integer, boolean>
---@param parent string
---@return string[]
function M.remove_files(pids, parent)
  local removed = {}
  for _, transport in ipairs(require("wsync.transport").with("named_leftovers")) do
    for _, path in ipairs((transport.remove_leftovers({}, pids))) do
      removed[#removed + 1] = path
    end
  end
  for entry, pid in require("wsync.util").named_entries(parent, "^wsync%-(%d+)%-%w%w%w%w%w%w$") do
    local path = parent .. "/" .. entry
    if pids[pid] then
      uv.fs_unlink(path .. "/control.sock")
      if uv.fs_rmdir(path) then
        removed[#removed + 1] = path
      end
    end
  end
  return removed
end

local function list(pids)
  local words = {}
  for i, pid in ipairs(pids) do
    words[i] = tostring(pid)
  end
  return table.concat(words, ", ")
end

--- The guard process's body (`wsync guard`): waits until host `options.host`
--- exits or closes the guard's stdin, then ends every process that carries
--- `options.mark` and, when the host died, removes what it left. Says what it
--- ended on stderr; silent when there was nothing to do. Must run in a
--- coroutine.
---@param options {host: integer, mark: string, grace_ms: integer?}
function M.main(options)
  local gone = loop.condition()
  local why = nil
  local function done(reason)
    why = why or reason
    gone:notify()
  end
  -- The watch first, then the check that the host is still this process's
  -- parent: a pidfd opened before that check names the host for sure.
  -- ($WSYNC_GUARD_WATCH=poll: as on a kernel without pidfd_open, for tests.)
  local fd = os.getenv("WSYNC_GUARD_WATCH") ~= "poll" and process.watch(options.host) or nil
  local watch = nil
  if fd then
    watch = uv.new_poll(fd)
    watch:start("r", function()
      done("died")
    end)
  end
  if uv.os_getppid() ~= options.host then
    done("died")
  end
  -- The host's lines: "watch SID", "unwatch SID", and "stand down" before
  -- it closes the pipe in order.
  local sessions, pending = {}, ""
  local stdin = uv.new_pipe(false)
  stdin:open(0)
  stdin:read_start(function(_, data)
    if not data then
      return done("died") -- (its end closed without a word: the host is exiting)
    end
    pending = pending .. data
    for line in pending:gmatch("([^\n]*)\n") do
      local verb, session = line:match("^(%a+) (%d+)$")
      if verb == "watch" then
        sessions[tonumber(session)] = true
      elseif verb == "unwatch" then
        sessions[tonumber(session)] = nil
      elseif line .. "\n" == M.STAND_DOWN then
        done("closed")
      end
    end
    pending = pending:match("[^\n]*$")
  end)
  local ticker = nil
  if not fd then
    -- (No pidfd on this kernel: the parent changes when the host dies.)
    ticker = uv.new_timer()
    ticker:start(100, 100, function()
      if uv.os_getppid() ~= options.host then
        done("died")
      end
    end)
  end
  gone:wait(function()
    return why ~= nil
  end)
  for _, handle in pairs({ watch = watch, stdin = stdin, ticker = ticker }) do
    if not handle:is_closing() then
      handle:close()
    end
  end
  if fd then
    uv.fs_close(fd)
  end
  local report = M.sweep(options.mark, { grace_ms = options.grace_ms,
    sessions = require("wsync.util").sorted_keys(sessions) })
  local pids = {}
  for _, pid in ipairs(report.terminated) do
    pids[pid] = true
  end
  if why == "died" then
    pids[options.host] = true
  end
  local removed = M.remove_files(pids, os.getenv("TMPDIR") or "/tmp")
  if #report.terminated > 0 then
    say("host pid %d %s; ended the %d processes it had started (%s)%s", options.host,
      why == "died" and "is gone" or "closed without ending them", #report.terminated, list(report.terminated),
      #report.killed > 0 and string.format(", %s with SIGKILL after %g s", list(report.killed),
        (options.grace_ms or M.GRACE_MS) / 1000) or "")
  end
  if #removed > 0 then
    say("removed what they left: %s", table.concat(removed, ", "))
  end
  if #report.left > 0 then
    say("processes %s did not end within %g s of SIGKILL", list(report.left), M.GIVE_UP_MS / 1000)
    return 1
  end
  return 0
end

return M
