-- Fail-stop of the runtime client, proved with injected faults: every fault
-- kind at every command (in the runtime's main process, and in a TP worker at
-- the commands that reach the workers). For each case: the error names the
-- cause; the client is BROKEN at once; afterwards no process of the runtime's
-- group exists (read from /proc) and no shared-memory segment was left; every
-- later request fails at once with the same cause.
local uv = require("luv")
local async = require("tests.helpers.async")
local shm_files = require("tests.helpers.shm")
local fault = require("wsync.control.fault")

local run_async = async.run_async
local runtime_helper = require("tests.helpers.runtime")

-- Short per-command timeouts keep the hanging cases quick; startup stays
-- generous except where the handshake itself is made to hang.
local TIMEOUTS = { startup = 10, info = 0.5, sleep = 0.5, wake = 0.5, shutdown = 0.5, default = 0.5 }
local HANDSHAKE_TIMEOUTS = { startup = 0.5 }
local GRACE_MS = 200

-- What the error must say for each kind: any one of these substrings.
local CAUSES = {
  crash = { "EOF", "exited" },
  hang = { "timeout" },
  stop = { "timeout" },
  stubborn = { "timeout" },
  eof = { "EOF" },
  wrong_id = { "does not match request id" },
  wrong_cmd = { "does not match request cmd" },
  wrong_protocol = { "protocol" },
  bad_result = { "not an object" },
  garbage = { "undecodable" },
  oversize = { "exceeds" },
  error = { "INJECTED" },
}

-- Kinds a worker is given (the others are the main process's own business:
-- the main checks its workers' answers with the same client code).
local WORKER_KINDS = { "crash", "hang", "stop", "stubborn", "error", "garbage", "wrong_id", "eof" }

-- The scenario every case drives; a fault fires at one of its steps.
local STEPS = {
  { cmd = "info" },
  { cmd = "sleep", payload = { level = 1 } },
  { cmd = "wake", payload = { tags = { "weights" } } },
  { cmd = "shutdown" }, -- through close()
}

local function sorted_kinds()
  local kinds = {}
  for kind in pairs(fault.KINDS) do
    kinds[#kinds + 1] = kind
  end
  table.sort(kinds)
  return kinds
end

-- The wsync segments in /dev/shm, as a set of names.
local function shm_listing()
  local names = {}
  local scanner = assert(uv.fs_scandir(shm_files.directory))
  while true do
    local name = uv.fs_scandir_next(scanner)
    if not name then
      break
    end
    if name:match("^wsync%-") then
      names[name] = true
    end
  end
  return names
end

-- Segments added since `before` by this process or one of `pids` (tests of
-- other programs may run beside this one and make their own).
local function added_segments(before, pids)
  local ours = { [uv.os_getpid()] = true }
  for _, pid in ipairs(pids) do
    ours[pid] = true
  end
  local added = {}
  for name in pairs(shm_listing()) do
    local creator = tonumber(name:match("^wsync%-(%d+)%-"))
    if not before[name] and ours[creator] then
      added[#added + 1] = name
    end
  end
  table.sort(added)
  return added
end

local function names_cause(message, kind)
  for _, expected in ipairs(CAUSES[kind]) do
    if message:find(expected, 1, true) then
      return true
    end
  end
  return false
end

local runtimes = runtime_helper.tracker()
local assert_tree_gone, worker_pids = runtime_helper.assert_tree_gone, runtime_helper.worker_pids

local function spawn(spec, timeouts)
  return runtimes.spawn({
    tp = 2,
    weights_bytes = 65536,
    kv_bytes = 65536,
    fault = spec,
    timeouts = timeouts or TIMEOUTS,
    grace_ms = GRACE_MS,
  })
end

-- Drives info -> sleep -> wake -> close and returns the first failure: the
-- error, the step's command, and the client's state right after it.
local function drive(client)
  for _, step in ipairs(STEPS) do
    if step.cmd == "shutdown" then
      -- close() ends CLOSED either way; the state right after a failed
      -- shutdown is the one it has when close() starts to wait for the tree.
      local seen = nil
      local wait_dead = client.wait_dead
      client.wait_dead = function(self)
        seen = seen or self.state
        return wait_dead(self)
      end
      local ok, cause = client:close()
      client.wait_dead = nil
      if not ok then
        return cause, step.cmd, seen
      end
    else
      local ok, err = pcall(client.request, client, step.cmd, step.payload)
      if not ok then
        return err, step.cmd, client.state
      end
    end
  end
  return nil
end

-- One case: `spec` makes `kind` happen at `cmd`; `rank` is the worker that
-- misbehaves, or nil for the main process.
local function check_case(spec, kind, cmd, rank)
  local before = shm_listing()
  local client = spawn(spec)
  local pids = worker_pids(client.startup_info)
  local err, failed_at, state = drive(client)

  assert.is_not_nil(err, spec .. " went unnoticed")
  assert.are.equal(cmd, failed_at, "failed at the wrong step: " .. tostring(err))
  assert.are.equal("RUNTIME_BROKEN", err.code, tostring(err))
  assert.are.equal(cmd, err.phase)
  assert.is_true(names_cause(err.message, kind),
    string.format("'%s' does not name the cause (%s)", err.message, table.concat(CAUSES[kind], " or ")))
  if rank then
    -- The worker, its pid and the command, also when the worker stopped
    -- answering: the main process's hop to it times out first.
    assert.matches(string.format("TP worker %d %%(pid %%d+%%) broken during %s", rank, cmd), err.message)
  end
  assert.are.equal("BROKEN", state)

  client:wait_dead()
  assert_tree_gone(client.group, client.pid, pids)
  assert.are.same({}, added_segments(before, { client.pid, unpack(pids) }))

  -- Later requests fail at once (no await: this coroutine does not yield)
  -- with the same cause.
  local started = uv.hrtime()
  for _, step in ipairs(STEPS) do
    if step.cmd ~= "shutdown" then
      local ok, again = pcall(client.request, client, step.cmd, step.payload)
      assert.is_false(ok)
      assert.are.equal(err, again)
    end
  end
  local ok, cause = client:close()
  assert.is_nil(ok)
  assert.are.equal(err, cause)
  assert.are.equal("CLOSED", client.state)
  local again_ok, again = pcall(client.request, client, "info")
  assert.is_false(again_ok)
  assert.are.equal(err, again, "after close, still the original cause")
  -- Below the 0.5 s command timeouts: none of them waited for an answer.
  assert.is_true(uv.hrtime() - started < 400e6, "later requests did not fail at once")
end

describe("runtime faults", function()
  local started_at

  setup(function()
    started_at = uv.hrtime()
  end)

  teardown(function()
    io.stderr:write(string.format("\nruntime faults: %.1f s\n", (uv.hrtime() - started_at) / 1e9))
  end)

  after_each(runtimes.cleanup)

  describe("in the main process", function()
    for _, kind in ipairs(sorted_kinds()) do
      for _, step in ipairs(STEPS) do
        local cmd = step.cmd
        local spec = kind .. "@" .. cmd .. (cmd == "info" and "#2" or "")
        if spec ~= "error@info#2" then
          it(string.format("%s: breaks during %s, naming the cause, leaving nothing", spec, cmd), function()
            run_async(function()
              check_case(spec, kind, cmd, nil)
            end)
          end)
        end
      end

      local spec = kind .. "@info#1"
      it(string.format("%s: the startup handshake fails with RUNTIME_START, leaving nothing", spec), function()
        run_async(function()
          local before = shm_listing()
          local ok, err = pcall(spawn, spec, HANDSHAKE_TIMEOUTS)
          assert.is_false(ok, "spawn succeeded")
          assert.are.equal("RUNTIME_START", err.code, tostring(err))
          assert.matches("reference runtime did not start: ", err.message, 1, true)
          assert.is_true(names_cause(err.message, kind),
            string.format("'%s' does not name the cause (%s)", err.message, table.concat(CAUSES[kind], " or ")))
          assert.is_number(err.group, "the error names the runtime's process group")
          assert.are.equal(err.pid, err.group)
          assert.are.equal("info", err.cause.phase)
          assert_tree_gone(err.group, err.pid, {})
          assert.are.same({}, added_segments(before, { err.pid }))
        end)
      end)
    end

    -- An answered failure of info is a clean refusal, not a broken runtime
    -- (only failed sleep, wake, weight and shutdown commands break it).
    it("error@info#2: info fails with RUNTIME_COMMAND_FAILED and the runtime stays usable", function()
      run_async(function()
        local before = shm_listing()
        local client = spawn("error@info#2")
        local pids = worker_pids(client.startup_info)
        local ok, err = pcall(client.request, client, "info")
        assert.is_false(ok)
        assert.are.equal("RUNTIME_COMMAND_FAILED", err.code)
        assert.are.equal("INJECTED", err.remote_code)
        assert.matches("injected failure of info", err.message, 1, true)
        assert.are.equal("IDLE", client.state)
        assert.is_nil(drive(client))
        assert.are.same({ code = 0, signal = 0 }, client.exit_status)
        assert_tree_gone(client.group, client.pid, pids)
        assert.are.same({}, added_segments(before, { client.pid, unpack(pids) }))
      end)
    end)
  end)

  describe("in a TP worker", function()
    for rank = 0, 1 do
      for _, kind in ipairs(WORKER_KINDS) do
        for _, cmd in ipairs({ "sleep", "wake", "shutdown" }) do
          local spec = string.format("worker%d:%s@%s", rank, kind, cmd)
          it(string.format("%s: breaks during %s, naming the cause, leaving nothing", spec, cmd), function()
            run_async(function()
              check_case(spec, kind, cmd, rank)
            end)
          end)
        end
      end
    end
  end)
end)
