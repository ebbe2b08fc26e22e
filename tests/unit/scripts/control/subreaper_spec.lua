-- wsync.control.subreaper: this process adopts the orphans below it only
-- while a hold lasts, and reaps what it adopted, never a child that the
-- loop waits for. (`wsync test` is the command line: it claims its children.)
local uv = require("luv")
local async = require("tests.helpers.async")
local loop = require("wsync.loop")
local subreaper = require("wsync.control.subreaper")

local own = uv.os_getpid()

-- The parent and state of process `pid` from /proc, or nil when it is gone
-- (reaped).
local function stat_of(pid)
  local file = io.open("/proc/" .. pid .. "/stat")
  if not file then
    return nil
  end
  local stat = file:read("*a")
  file:close()
  local state, parent = stat:match("^.*%) (%a) (%d+) ")
  return tonumber(parent), state
end

-- Starts a shell that starts `sleep SECONDS` and exits at once, orphaning
-- it; returns the sleep's pid once the shell was reaped. Must run in a
-- coroutine.
local function orphan(seconds)
  local out = uv.new_pipe(false)
  local text, exited, closed = {}, false, false
  local handle
  local script = "sleep " .. seconds .. " >/dev/null & echo $!" -- (the sleep holds no end of the pipe)
  handle = uv.spawn("sh", { args = { "-c", script }, stdio = { nil, out, 2 } }, function()
    exited = true
    handle:close()
  end)
  assert(handle)
  out:read_start(function(err, data)
    assert(not err, err)
    if data then
      text[#text + 1] = data
    else
      closed = true
      out:close()
    end
  end)
  while not (exited and closed) do
    loop.sleep(5)
  end
  return assert(tonumber(table.concat(text):match("%d+")), "no pid from the shell")
end

-- Waits (in a coroutine) until `predicate()` holds, at most `ms`.
local function wait_until(predicate, ms, what)
  local deadline = uv.hrtime() + ms * 1e6
  while not predicate() do
    assert(uv.hrtime() < deadline, "not within " .. ms .. " ms: " .. what)
    loop.sleep(5)
  end
end

-- Ends the orphan `pid` (this process's child or not) and waits until it is
-- gone.
local function end_orphan(pid)
  uv.kill(pid, "sigkill")
  wait_until(function()
    local parent, state = stat_of(pid)
    return parent == nil or (parent ~= own and state == "Z")
  end, 5000, "orphan " .. pid .. " ends")
end

describe("wsync.control.subreaper", function()
  it("adopts the orphans of a held tree and reaps them as they end, also after the release", function()
    local hold = subreaper.hold()
    finally(function()
      hold:release()
    end)
    async.run_async(function()
      local pid = orphan(0.3)
      local parent = stat_of(pid)
      hold:release()
      assert.are.equal(own, parent, "the orphan did not come to this process")
      -- It ends after the release: reaped all the same (a zombie stays in /proc).
      wait_until(function()
        return stat_of(pid) == nil
      end, 5000, "the adopted orphan is reaped")
    end)
  end)

  it("is a subreaper while any hold lasts and no longer once the last is released", function()
    local first, second = subreaper.hold(), subreaper.hold()
    finally(function()
      first:release()
      second:release()
    end)
    async.run_async(function()
      first:release()
      first:release() -- (again: nothing)
      local adopted = orphan(5)
      second:release()
      local elsewhere = orphan(5)
      local adopted_parent, elsewhere_parent = stat_of(adopted), stat_of(elsewhere)
      end_orphan(adopted)
      end_orphan(elsewhere)
      assert.are.equal(own, adopted_parent, "not adopted while a hold lasts")
      assert.are_not.equal(own, elsewhere_parent, "still adopted after the last release")
      assert.is_nil(stat_of(adopted), "the adopted orphan was not reaped")
    end)
  end)

  it("leaves the children the loop waits for to the loop, which sees each one's exit", function()
    local hold = subreaper.hold()
    finally(function()
      hold:release()
    end)
    async.run_async(function()
      local statuses, reported = {}, 0
      for i = 1, 20 do
        local handle
        handle = uv.spawn("sh", { args = { "-c", "exit " .. i } }, function(code)
          statuses[i], reported = code, reported + 1
          handle:close()
        end)
        assert(handle)
      end
      wait_until(function()
        return reported == 20
      end, 10000, "every child's exit is reported")
      for i = 1, 20 do
        assert.are.equal(i, statuses[i])
      end
    end)
  end)

  it("reaps an exited child that no process handle waits for", function()
    local handle, pid = uv.spawn("true", {}, function() end)
    assert(handle, pid)
    handle:close() -- (libuv no longer waits for it)
    uv.run("nowait")
    local deadline = uv.hrtime() + 5e9
    while select(2, stat_of(pid)) ~= "Z" and uv.hrtime() < deadline do
      uv.sleep(1)
    end
    assert.are.equal("Z", select(2, stat_of(pid)))
    local reaped = subreaper.reap_adopted()
    assert.is_true(reaped >= 1)
    assert.is_nil(stat_of(pid), "still in /proc")
  end)
end)
