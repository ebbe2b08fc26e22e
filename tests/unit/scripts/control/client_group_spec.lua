-- wsync.control.client's end of a process tree: the group is empty when
-- kill(-group, 0) says ESRCH, whatever a scan of /proc could read. A tree
-- whose group cannot be scanned (count_group answering nil, as when /proc is
-- unreadable) is waited for, not taken for gone.
local uv = require("luv")
local async = require("tests.helpers.async")
local client_module = require("wsync.control.client")
local process = require("wsync._process")

describe("wsync.control.client group_empty and the tree's collection", function()
  it("says a live group is not empty, and an ended one is", function()
    local handle, pid
    handle, pid = uv.spawn("sleep", { args = { "5" }, detached = true }, function()
      handle:close()
    end)
    assert(handle, pid)
    assert.is_false(client_module.group_empty(pid))
    uv.process_kill(handle, "sigkill")
    while not handle:is_closing() do
      uv.run("once")
    end
    uv.run("nowait")
    assert.is_true(client_module.group_empty(pid))
  end)

  it("waits for the group's last member even when the group cannot be scanned", function()
    -- A shell in its own group starts a member that outlives it by 0.5 s.
    local handle, pid
    handle, pid = uv.spawn("sh", { args = { "-c", "sleep 0.5 & exec true" }, detached = true }, function()
      handle:close()
    end)
    assert(handle, pid)
    while not handle:is_closing() do
      uv.run("once")
    end
    local count_group = process.count_group
    process.count_group = function()
      return nil, "cannot read /proc", "WS_ESYS"
    end
    local ok, err = pcall(async.run_async, function()
      local client = setmetatable({ group = pid, grace_ms = 5000, death = require("wsync.loop").condition(),
        dead = false },
        client_module.Client)
      local started = uv.hrtime()
      client:_collect_tree()
      client:wait_dead()
      local waited = (uv.hrtime() - started) / 1e9
      assert.is_true(client_module.group_empty(pid), "marked dead while its group lives")
      assert.is_true(waited > 0.3, string.format("marked dead after %.3f s, before the member ended", waited))
    end)
    process.count_group = count_group
    uv.run("nowait")
    assert(ok, err)
  end)
end)
