--- Test helper for specs that spawn reference runtimes: /proc checks of a
--- runtime's process tree and a tracker that ends what a failing test left.
local uv = require("luv")
local assert = require("luassert")
local async = require("tests.helpers.async")
local process_helper = require("tests.helpers.process")
local process = require("wsync._process")
local runtime = require("wsync.runtime")

local M = {}

--- True while /proc has the process.
---@param pid integer
function M.exists(pid)
  return uv.fs_stat("/proc/" .. pid) ~= nil
end

--- The worker pids of an `info` answer, by rank (1-based).
function M.worker_pids(info)
  local pids = {}
  for rank, worker in ipairs(info.workers) do
    pids[rank] = worker.pid
  end
  return pids
end

--- Asserts that process group `group` (main `pid`, workers `workers`) is
--- gone: no member left in /proc, and none of the pids exists.
function M.assert_tree_gone(group, pid, workers)
  assert.are.equal(0, process.count_group(group), "a process of the runtime's group survived")
  assert.is_false(M.exists(pid), "the main process " .. pid .. " survived")
  for _, worker in ipairs(workers or {}) do
    assert.is_false(M.exists(worker), "worker " .. worker .. " survived")
  end
end

--- A tracker: `spawn(options)` starts a runtime of this build and remembers
--- it; `cleanup()` (for after_each) kills and reaps whatever is left and
--- asserts that no group member outlived the test (the preload checks the
--- loop's handles).
function M.tracker()
  local spawned = {}
  local self = {}
  function self.spawn(options)
    options.program = process_helper.wsync_binary()
    local client = runtime.spawn(options)
    spawned[#spawned + 1] = client
    return client
  end
  function self.cleanup()
    local left = spawned
    spawned = {}
    for _, client in ipairs(left) do
      if not client.dead then
        process.signal_group(client.group, "SIGKILL")
        async.run_async(function()
          client:wait_dead()
        end, 5000)
      end
      assert.are.equal(0, process.count_group(client.group), "the runtime's group outlived the test")
    end
  end
  return self
end

return M
