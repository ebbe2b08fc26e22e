-- wsync.control.guard's parts, in this process: finding a tree by the mark in
-- its members' environment (whatever session they moved to), a pidfd watch
-- on one process, the sweep that ends a tree (SIGTERM, SIGKILL after the
-- grace period) and the removal of what dead processes left named for
-- themselves. The guard process itself, with a host that dies, is
-- tests/functional/control/guard_spec.lua.
local uv = require("luv")
local guard = require("wsync.control.guard")
local process = require("wsync._process")
local helpers = require("tests.helpers.process")
local util = require("wsync.util")

local function random_mark()
  return string.format("WSYNC_GUARD_SPEC=%d-%d", uv.os_getpid(), math.random(1, 1e9))
end

-- Starts `script` under sh with `entry` in its environment, in a session of
-- its own; returns the handle and pid (the handle closes itself at exit).
local function start_tree(script, entry)
  local handle, pid
  handle, pid = uv.spawn("sh", { args = { "-c", script }, env = util.environment({ entry }), detached = true },
    function()
      handle:close()
    end)
  assert(handle, pid)
  return handle, pid
end

-- Waits until `predicate()` holds, looking every 10 ms (what it looks at,
-- /proc, wakes no loop).
local function wait_for(predicate, ms, what)
  local ticker = uv.new_timer()
  ticker:start(10, 10, function() end)
  local ok, err = pcall(helpers.drive, predicate, ms, what)
  ticker:close()
  uv.run("nowait")
  assert(ok, err)
end

local function sorted(list)
  table.sort(list)
  return list
end

describe("process.find_marked", function()
  it("finds every process carrying the entry exactly, whatever session it moved to", function()
    local entry = random_mark()
    local handle, pid = start_tree("sleep 30 & setsid sleep 31 & exec sleep 32", entry)
    local other_handle, other = start_tree("exec sleep 33", entry .. "0") -- a longer value: not the same entry
    wait_for(function()
      return #assert(process.find_marked(entry)) == 3
    end, 5000, "three marked processes")
    local found = sorted(assert(process.find_marked(entry)))
    local has_shell = false
    for _, member in ipairs(found) do
      has_shell = has_shell or member == pid
      assert.are_not.equal(other, member)
    end
    assert.is_true(has_shell, "the tree's first process was not found")
    assert.are.same({ other }, process.find_marked(entry .. "0"))
    for _, member in ipairs(found) do
      uv.kill(member, "sigkill")
    end
    uv.kill(other, "sigkill")
    wait_for(function()
      return #process.find_marked(entry) == 0 and #process.find_marked(entry .. "0") == 0
    end, 5000, "the marked processes to end")
    wait_for(function()
      return handle:is_closing() and other_handle:is_closing()
    end, 5000, "the shells' exits")
    uv.run("nowait")
  end)

  it("finds the members of the given sessions too, without the mark, but no zombie", function()
    local entry = random_mark()
    local name = entry:match("^[^=]+")
    local handle, pid = start_tree("env -u " .. name .. " sleep 30 & exec sleep 31", entry)
    -- (Until `env -u` has run, the shell's forked child still carries the
    -- mark it inherited: wait for the environment it execs with.)
    wait_for(function()
      return #assert(process.find_marked(entry, { pid })) == 2 and #assert(process.find_marked(entry)) == 1
    end, 5000, "the session's two processes, one of them without the mark")
    assert.are.same({ pid }, process.find_marked(entry)) -- (the other has no mark)
    local unmarked = nil
    for _, member in ipairs(process.find_marked(entry, { pid })) do
      unmarked = member ~= pid and member or unmarked
    end
    -- The session's leader killed and not reaped (the loop does not run): a
    -- zombie, which holds nothing.
    uv.kill(pid, "sigkill")
    uv.sleep(200)
    local zombie_found = process.find_marked(entry, { pid })
    uv.kill(unmarked, "sigkill")
    wait_for(function()
      return handle:is_closing() and #process.find_marked(entry, { pid }) == 0
    end, 5000, "the session's end")
    assert.are.same({ unmarked }, zombie_found)
  end)

  it("refuses what is not NAME=VALUE", function()
    assert.has_error(function()
      process.find_marked("NOEQUALS")
    end)
  end)
end)

describe("process.watch", function()
  -- (valgrind 3.19 knows no pidfd_open: the guard then watches its parent.)
  local probe, why, why_code = process.watch(uv.os_getpid())
  if not probe and why_code == "ENODEV" then
    pending("no pidfd here: " .. why)
    return
  end
  uv.fs_close(probe)

  it("gives a descriptor that becomes readable when the process exits", function()
    local handle, pid = start_tree("exec sleep 30", random_mark())
    local fd = assert(process.watch(pid))
    local readable = false
    local poll = uv.new_poll(fd)
    poll:start("r", function()
      readable = true
    end)
    uv.run("nowait")
    assert.is_false(readable)
    uv.kill(pid, "sigkill")
    wait_for(function()
      return readable and handle:is_closing()
    end, 5000, "the watch to fire")
    poll:close()
    uv.fs_close(fd)
    uv.run("nowait")
  end)

  it("says ENOTFOUND for a process that is not there", function()
    local handle, pid = start_tree("exit 0", random_mark())
    wait_for(function()
      return handle:is_closing()
    end, 5000, "the shell's exit")
    uv.run("nowait")
    local fd, message, code = process.watch(pid)
    assert.is_nil(fd)
    assert.are.equal("ENOTFOUND", code, message)
  end)
end)

describe("guard.sweep", function()
  it("ends a marked tree: SIGTERM, then SIGKILL to what ignores it after the grace period", function()
    local entry = random_mark()
    -- A process that SIGTERM ends, and a shell and its child that ignore it.
    start_tree("exec sleep 31", entry)
    start_tree("trap '' TERM; sleep 30 & wait", entry)
    wait_for(function()
      return #assert(process.find_marked(entry)) == 3
    end, 5000, "three marked processes")
    local report = helpers.in_coroutine(function()
      local started = uv.hrtime()
      local result = guard.sweep(entry, { grace_ms = 300 })
      result.seconds = (uv.hrtime() - started) / 1e9
      return result
    end)
    assert.are.same({}, process.find_marked(entry))
    assert.are.equal(3, #report.terminated)
    -- (The shell's child inherited its ignored SIGTERM: both needed SIGKILL.)
    assert.are.equal(2, #report.killed)
    assert.are.same({}, report.left)
    assert.is_true(report.seconds >= 0.3, "SIGKILL came before the grace period: " .. report.seconds)
    uv.run("nowait")
  end)

  it("returns at once when nothing carries the mark", function()
    local report = helpers.in_coroutine(function()
      return guard.sweep(random_mark())
    end)
    assert.are.same({ terminated = {}, killed = {}, left = {} }, report)
  end)
end)

describe("guard.remove_files", function()
  it("removes the segments and control directories named for the given pids only", function()
    local parent = assert(uv.fs_mkdtemp((os.getenv("TMPDIR") or "/tmp") .. "/guard-spec-XXXXXX"))
    local dead, other = 2 ^ 22 + 17, 2 ^ 22 + 18 -- (pids no process has: above the default pid_max)
    local names = {
      string.format("/dev/shm/wsync-%d-0123456789abcdef", dead),
      string.format("/dev/shm/wsync-%d-0123456789abcdef", other),
    }
    for _, name in ipairs(names) do
      local fd = assert(uv.fs_open(name, "w", tonumber("600", 8)))
      uv.fs_close(fd)
    end
    local directory = string.format("%s/wsync-%d-abcDEF", parent, dead)
    local kept = string.format("%s/wsync-%d-abcDEF", parent, other)
    assert(uv.fs_mkdir(directory, tonumber("700", 8)))
    assert(uv.fs_mkdir(kept, tonumber("700", 8)))
    local removed = guard.remove_files({ [dead] = true }, parent)
    table.sort(removed)
    local expected = { string.format("/wsync-%d-0123456789abcdef", dead), directory }
    table.sort(expected)
    local gone_segment = uv.fs_stat(names[1]) == nil
    local other_segment = uv.fs_stat(names[2]) ~= nil
    local gone_directory = uv.fs_stat(directory) == nil
    local other_directory = uv.fs_stat(kept) ~= nil
    uv.fs_unlink(names[2])
    uv.fs_rmdir(kept)
    uv.fs_rmdir(directory)
    uv.fs_unlink(names[1])
    uv.fs_rmdir(parent)
    assert.are.same(expected, removed)
    assert.is_true(gone_segment and gone_directory, "what the dead pid left is still there")
    assert.is_true(other_segment and other_directory, "what another pid left was removed")
  end)
end)
