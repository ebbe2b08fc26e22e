--- Test helper: runs the wsync binary marked, and reports what the run left.
---
--- The child gets a unique marker in its environment ($WSYNC_TEST_MARKER),
--- which every process it starts inherits, and a fresh $TMPDIR (where a host
--- puts its control socket). While it runs, /proc is polled for marked
--- processes, so that the pids of short-lived children (trainers, the runtime,
--- its workers) are known. Afterwards the helper reports, and then removes so
--- that a failing test leaves nothing behind:
---   - marked processes still alive, and zombie children of this process;
---   - /dev/shm segments named for a process of the run ("wsync-<pid>-...");
---   - files left in the run's $TMPDIR.
--- Other tests may run beside this one and make their own processes and
--- segments; only those of the run's processes count.
local uv = require("luv")
local process = require("tests.helpers.process")
local shm_files = require("tests.helpers.shm")

local M = {}

--- How often /proc is scanned while the child runs, in ms.
M.POLL_MS = 5

local counter = 0

local function read_file(path)
  local file = io.open(path, "rb")
  if not file then
    return nil
  end
  local text = file:read("*a")
  file:close()
  return text
end

local function pids()
  local list = {}
  local scanner = uv.fs_scandir("/proc")
  while scanner do
    local name = uv.fs_scandir_next(scanner)
    if not name then
      break
    end
    if name:match("^%d+$") then
      list[#list + 1] = tonumber(name)
    end
  end
  return list
end

--- Pids of live processes (other than this one) whose environment holds the
--- entry `entry` ("KEY=VALUE").
---@param entry string
---@return integer[]
function M.with_environment(entry)
  local found = {}
  local needle = entry .. "\0"
  local own = uv.os_getpid()
  for _, pid in ipairs(pids()) do
    if pid ~= own then
      local environ = read_file("/proc/" .. pid .. "/environ")
      if environ and (environ .. "\0"):find(needle, 1, true) then
        found[#found + 1] = pid
      end
    end
  end
  table.sort(found)
  return found
end

--- Pids of live processes whose environment holds `marker`.
---@param marker string
---@return integer[]
function M.marked(marker)
  return M.with_environment("WSYNC_TEST_MARKER=" .. marker)
end

--- Pids of this process's zombie children (a leaked process re-parented here
--- that died unreaped).
function M.zombie_children()
  local own = uv.os_getpid()
  local found = {}
  for _, pid in ipairs(pids()) do
    local stat = read_file("/proc/" .. pid .. "/stat")
    -- (Not `stat and stat:match(...)`: `and` keeps only the first capture. The
    -- command name may hold ") ": the state follows the last one.)
    local state, parent
    if stat then
      state, parent = stat:match("^.*%) (%a) (%d+) ")
    end
    if state == "Z" and tonumber(parent) == own then
      found[#found + 1] = pid
    end
  end
  return found
end

--- /dev/shm segments named for a process of `pid_set` ({[pid] = true}).
---@param pid_set table<integer, boolean>
---@return string[]
function M.segments_of(pid_set)
  local found = {}
  local scanner = uv.fs_scandir(shm_files.directory)
  while scanner do
    local name = uv.fs_scandir_next(scanner)
    if not name then
      break
    end
    local creator = tonumber(name:match("^wsync%-(%d+)%-"))
    if creator and pid_set[creator] then
      found[#found + 1] = name
    end
  end
  table.sort(found)
  return found
end

local function remove_tree(path)
  local scanner = uv.fs_scandir(path)
  local names = {}
  while scanner do
    local name, kind = uv.fs_scandir_next(scanner)
    if not name then
      break
    end
    names[#names + 1] = name
    if kind == "directory" then
      for _, inner in ipairs(remove_tree(path .. "/" .. name)) do
        names[#names + 1] = name .. "/" .. inner
      end
      uv.fs_rmdir(path .. "/" .. name)
    else
      uv.fs_unlink(path .. "/" .. name)
    end
  end
  return names
end

---@class MarkedResult: ProcessResult
---@field marker string
---@field pid integer              the wsync process
---@field pids table<integer, boolean> every marked process seen during the run
---@field wall number              seconds
---@field settled number?          seconds after its exit until its marked processes ended (options.settle_ms)
---@field leftovers {processes: integer[], zombies: integer[], segments: string[], files: string[]}

--- Runs wsync with `args`; `options.env` ({"K=V"}) adds to its environment,
--- `options.timeout` (ms, default 60000) ends it, `options.signal` sends the
--- signal `name` ("sigint") once stdout shows the text `after`, `options.stdin`
--- is its input (none by default), `options.settle_ms` waits up to that long
--- after its exit for its marked processes to end (`settled`: the seconds
--- that took) before what is left is collected. Returns a MarkedResult.
---@param args string[]
---@param options {env: string[]?, timeout: integer?, signal: {after: string, name: string}?, stdin: string?,
---  settle_ms: integer?}?
---@return MarkedResult
function M.run(args, options)
  options = options or {}
  counter = counter + 1
  local marker = string.format("%d-%d-%08x", uv.os_getpid(), counter, math.random(0, 0x7fffffff))
  local tmpdir = assert(uv.fs_mkdtemp((os.getenv("TMPDIR") or "/tmp") .. "/wsync-test-XXXXXX"))
  local env = { "WSYNC_TEST_MARKER=" .. marker, "TMPDIR=" .. tmpdir }
  for _, entry in ipairs(options.env or {}) do
    env[#env + 1] = entry
  end
  local seen, child, child_handle, stdout_so_far, signalled = {}, nil, nil, nil, false
  local poll = uv.new_timer()
  local function scan()
    for _, pid in ipairs(M.marked(marker)) do
      seen[pid] = true
    end
    local signal = options.signal
    if signal and not signalled and stdout_so_far():find(signal.after, 1, true) then
      signalled = true
      uv.process_kill(child_handle, signal.name)
    end
  end
  local started = uv.hrtime()
  local ran, result = pcall(process.run, {
    args = args,
    env = env,
    timeout = options.timeout or 60000,
    on_start = function(handle, stdin, pid, stdout)
      child, child_handle, stdout_so_far = pid, handle, stdout
      seen[pid] = true
      if options.stdin then
        stdin:write(options.stdin)
      end
      stdin:shutdown(function()
        stdin:close()
      end)
      poll:start(0, M.POLL_MS, scan)
    end,
  })
  poll:stop()
  poll:close()
  uv.run("nowait")
  if not ran then -- it did not start: nothing ran, but the directory exists
    uv.fs_rmdir(tmpdir)
    error(result, 0)
  end
  result.wall = (uv.hrtime() - started) / 1e9
  result.marker, result.pid, result.pids = marker, child, seen
  if options.settle_ms then
    -- (What outlives the process may take a moment to end: its guard's work.)
    local deadline = uv.hrtime() + options.settle_ms * 1e6
    while #M.marked(marker) > 0 and uv.hrtime() < deadline do
      for _, pid in ipairs(M.marked(marker)) do
        seen[pid] = true
      end
      uv.sleep(M.POLL_MS)
    end
    result.settled = (uv.hrtime() - started) / 1e9 - result.wall
  end

  -- What is left, then cleaned up.
  local leftovers = { processes = M.marked(marker), zombies = M.zombie_children() }
  for _, pid in ipairs(leftovers.processes) do
    seen[pid] = true
    uv.kill(pid, "sigkill")
  end
  leftovers.segments = M.segments_of(seen)
  for _, name in ipairs(leftovers.segments) do
    uv.fs_unlink(shm_files.directory .. "/" .. name)
  end
  leftovers.files = remove_tree(tmpdir)
  uv.fs_rmdir(tmpdir)
  result.leftovers = leftovers
  return result
end

--- Asserts that `result` left nothing, with a message naming what it left.
---@param result MarkedResult
function M.assert_clean(result)
  local left = result.leftovers
  local function listed(values)
    local text = {}
    for _, value in ipairs(values) do
      text[#text + 1] = tostring(value)
    end
    return table.concat(text, ", ")
  end
  assert(#left.processes == 0, "processes of the run are still alive: " .. listed(left.processes))
  assert(#left.zombies == 0, "zombie children left unreaped: " .. listed(left.zombies))
  assert(#left.segments == 0, "shared-memory segments left in /dev/shm: " .. listed(left.segments))
  assert(#left.files == 0, "files left in the run's TMPDIR: " .. listed(left.files))
end

--- Lines of a text, without their newlines.
function M.lines(text)
  local out = {}
  for line in text:gmatch("([^\n]*)\n") do
    out[#out + 1] = line
  end
  return out
end

return M
