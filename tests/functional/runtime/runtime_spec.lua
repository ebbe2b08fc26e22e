-- The reference rollout runtime, healthy behaviour: spawned by the host in its
-- own process group, driven over the control protocol, closed politely, and
-- destroyed whole when it misbehaves from the outside.
local uv = require("luv")
local async = require("tests.helpers.async")
local process_helper = require("tests.helpers.process")
local channel = require("wsync.control.channel")
local device = require("wsync.native.device")
local loop = require("wsync.loop")
local process = require("wsync._process")
local protocol = require("wsync.control.protocol")
local shm = require("wsync.native.shm")
local subreaper = require("wsync.control.subreaper")

local run_async = async.run_async
local runtime_helper = require("tests.helpers.runtime")

local WEIGHTS_BYTES = 262144

local runtimes = runtime_helper.tracker()
local exists, worker_pids = runtime_helper.exists, runtime_helper.worker_pids

local function spawn(options)
  options = options or {}
  options.tp = options.tp or 2
  options.weights_bytes = options.weights_bytes or WEIGHTS_BYTES
  return runtimes.spawn(options)
end

-- Waits (in a coroutine) until `predicate()` holds; fails after `ms`.
local function wait_until(predicate, ms, what)
  local deadline = uv.now() + (ms or 5000)
  while not predicate() do
    assert(uv.now() < deadline, "timed out waiting until " .. what)
    loop.sleep(5)
  end
end

-- Runs `fn` and returns the error it raised (fails when it raised nothing).
local function raised(fn, ...)
  local ok, err = pcall(fn, ...)
  assert.is_false(ok, "expected an error")
  return err
end

-- Asserts that the client's whole process tree is gone (read from /proc).
local function assert_tree_gone(client, pids)
  runtime_helper.assert_tree_gone(client.group, client.pid, pids)
end

describe("the reference runtime", function()
  after_each(runtimes.cleanup)

  it("answers info for TP 2: two workers, their host devices, weights awake", function()
    run_async(function()
      local client = spawn()
      assert.are.equal("IDLE", client.state)
      local info = client:request("info")
      assert.are.equal("reference", info.runtime)
      assert.are.equal(protocol.VERSION, info.protocol)
      assert.are.equal(2, info.tp_world)
      assert.are.equal("host", info.backend)
      assert.are.equal(client.pid, info.pid)
      assert.are.same({ weights = "awake", kv_cache = "free" }, info.state)
      assert.are.equal(2, #info.workers)
      for rank, worker in ipairs(info.workers) do
        assert.are.equal(rank - 1, worker.rank)
        assert.are.equal("awake", worker.state.weights)
        assert.are.equal(WEIGHTS_BYTES, worker.memory.device_bytes)
        assert.are.equal(rank - 1, worker.device.index)
        assert.are.equal(assert(device.query("host", rank - 1)).uuid, worker.device.uuid)
        assert.is_true(exists(worker.pid))
      end
      assert.are_not.equal(info.workers[1].pid, info.workers[2].pid)
      assert.are_not.equal(info.workers[1].device.uuid, info.workers[2].device.uuid)
      assert.are.same(info.workers, client.startup_info.workers, "the handshake saw the same workers")
      -- Main process and both workers, in the runtime's own group.
      assert.are.equal(client.pid, client.group)
      assert.are.equal(3, process.count_group(client.group))
      assert.is_true(client:close())
    end)
  end)

  it("sleeps at level 1 and wakes the weights back byte for byte", function()
    run_async(function()
      local client = spawn()
      local before = client:request("checksum").workers
      assert.are.equal(2, #before)
      assert.are_not.equal(before[1].weights, before[2].weights, "each rank has its own dummy weights")
      local asleep = client:request("sleep", { level = 1 })
      assert.are.same({ weights = "offloaded", kv_cache = "free" }, asleep.state)
      for _, worker in ipairs(asleep.workers) do
        assert.are.same({ device_bytes = 0, host_bytes = WEIGHTS_BYTES }, worker.memory)
      end
      assert.is_nil(client:request("checksum").workers[1].weights)
      local awake = client:request("wake", { tags = { "weights" } })
      assert.are.same({ weights = "awake", kv_cache = "free" }, awake.state)
      assert.are.same(before, client:request("checksum").workers)
      assert.is_true(client:close())
    end)
  end)

  it("sleeps at level 2 and wakes zeroed weights", function()
    run_async(function()
      local client = spawn()
      local before = client:request("checksum").workers
      local zeros = assert(shm.anonymous(WEIGHTS_BYTES))
      local zero_digest = zeros:sha256()
      zeros:close()
      local asleep = client:request("sleep", { level = 2 })
      assert.are.equal("discarded", asleep.state.weights)
      assert.are.same({ device_bytes = 0, host_bytes = 0 }, asleep.workers[1].memory)
      client:request("wake", { tags = { "weights" } })
      local after = client:request("checksum").workers
      for rank = 1, 2 do
        assert.are_not.equal(before[rank].weights, after[rank].weights)
        assert.are.equal(zero_digest, after[rank].weights)
      end
      assert.is_true(client:close())
    end)
  end)

  it("wakes the KV cache after the weights and frees it on sleep", function()
    run_async(function()
      local client = spawn({ kv_bytes = 65536 })
      local awake = client:request("wake", { tags = { "weights", "kv_cache" } })
      assert.are.same({ weights = "awake", kv_cache = "reserved" }, awake.state)
      assert.are.equal(WEIGHTS_BYTES + 65536, awake.workers[2].memory.device_bytes)
      assert.is_string(client:request("checksum").workers[1].kv_cache)
      local asleep = client:request("sleep", { level = 1 })
      assert.are.same({ weights = "offloaded", kv_cache = "free" }, asleep.state)
      assert.is_true(client:close())
    end)
  end)

  -- A refused sleep or wake is a failed sleep or wake: the runtime's memory
  -- state is unknown, so the client breaks and destroys the tree.
  local refusals = {
    { "wake kv_cache while the weights sleep", { { "sleep", { level = 1 } }, { "wake", { tags = { "kv_cache" } } } },
      "cannot wake kv_cache while the weights are offloaded: wake weights first" },
    { "sleep at level 3", { { "sleep", { level = 3 } } }, "sleep level must be 1 or 2, got 3" },
    { "sleep without a level", { { "sleep", {} } }, "sleep level must be 1 or 2, got nil" },
    { "wake an unknown tag", { { "wake", { tags = { "weights", "lora" } } } }, "unknown wake tag 'lora'" },
    { "wake without tags", { { "wake", {} } }, "wake needs a non-empty list of tags" },
  }
  for _, case in ipairs(refusals) do
    local name, steps, expected = case[1], case[2], case[3]
    it("refuses to " .. name .. " and breaks, naming the refusal", function()
      run_async(function()
        local client = spawn()
        local pids = worker_pids(client.startup_info)
        for i = 1, #steps - 1 do
          client:request(steps[i][1], steps[i][2])
        end
        local last = steps[#steps]
        local err = raised(client.request, client, last[1], last[2])
        assert.are.equal("RUNTIME_BROKEN", err.code)
        assert.are.equal(last[1], err.phase)
        assert.matches(expected, err.message, 1, true)
        assert.matches("TP worker 0", err.message, 1, true)
        assert.are.equal("BROKEN", client.state)
        client:wait_dead()
        assert_tree_gone(client, pids)
        local ok, cause = client:close()
        assert.is_nil(ok)
        assert.are.equal(err, cause)
      end)
    end)
  end

  it("refuses generate until the KV cache is reserved, staying usable, then generates deterministically",
    function()
      run_async(function()
        local client = spawn()
        local err = raised(client.request, client, "generate", { prompts = { { 1, 2 } } })
        assert.are.equal("RUNTIME_COMMAND_FAILED", err.code)
        assert.are.equal("STATE_REFUSED", err.remote_code)
        assert.matches("the KV cache is free", err.message, 1, true)
        assert.are.equal("IDLE", client.state)
        client:request("wake", { tags = { "kv_cache" } })
        local bad = raised(client.request, client, "generate", { prompts = { "hello" } })
        assert.are.equal("INVALID_ARGUMENT", bad.remote_code)
        local one = client:request("generate", { prompts = { { 1, 2, 3 }, { 4 } }, sampling = { max_tokens = 6 } })
        local two = client:request("generate", { prompts = { { 1, 2, 3 } }, sampling = { max_tokens = 6 } })
        assert.are.equal(0, one.model_version)
        assert.are.same(one.outputs[1].token_ids, two.outputs[1].token_ids)
        assert.are_not.same(one.outputs[1].token_ids, one.outputs[2].token_ids)
        assert.are.equal(6, #one.outputs[1].logprobs)
        assert.are.same({ { version = 0, first_token = 0, last_token = 5 } }, one.outputs[1].spans)
        assert.is_true(client:close())
        assert.are.equal(0, client.exit_status.code)
      end)
    end)

  it("streams several requests at once: submit, then poll what each produced since the last poll", function()
    run_async(function()
      local client = spawn()
      client:request("wake", { tags = { "kv_cache" } })
      local ids = client:request("submit", { requests = { { prompt = { 5 }, max_tokens = 400 },
        { prompt = { 6, 7 }, max_tokens = 3 } } }).ids
      assert.are.same({ 1, 2 }, ids)
      local seen, rounds, short = {}, 0, nil
      while rounds < 2000 do
        rounds = rounds + 1
        local polled = client:request("poll", {})
        for _, request in ipairs(polled.requests) do
          local got = seen[request.id] or {}
          assert.are.equal(#got, request.first_token, "a poll starts where the last one ended")
          for _, token in ipairs(request.tokens) do
            got[#got + 1] = token
          end
          seen[request.id] = got
          if request.id == 2 and request.done then
            short = request
          end
        end
        if #(seen[1] or {}) >= 400 then
          break
        end
        loop.sleep(2)
      end
      assert.are.equal(400, #seen[1])
      assert.are.equal(3, #seen[2])
      assert.is_true(short.done)
      -- Finished and polled: forgotten.
      assert.are.same({}, client:request("poll", {}).requests)
      assert.is_true(client:close())
    end)
  end)

  it("holds requests that arrive while it is paused, and starts them at resume", function()
    run_async(function()
      local client = spawn()
      client:request("wake", { tags = { "kv_cache" } })
      assert.are.same({ mode = "keep", aborted = 0, finished = 0, held = 0 },
        client:request("pause", { mode = "keep" }))
      local refused = raised(client.request, client, "generate", { prompts = { { 1 } } })
      assert.are.equal("STATE_REFUSED", refused.remote_code)
      assert.matches("generation is paused (keep): resume first", refused.message, 1, true)
      local id = client:request("submit", { requests = { { prompt = { 8 }, max_tokens = 50 } } }).ids[1]
      loop.sleep(20)
      assert.are.equal(0, client:request("poll", { ids = { id } }).requests[1].generated, "held while paused")
      assert.are.equal("keep", client:request("info").generation.paused)
      client:request("resume", {})
      local done, generated = nil, 0
      wait_until(function()
        done = client:request("poll", { ids = { id } }).requests[1]
        generated = generated + #done.tokens
        return done.done
      end, 10000, "the held request finishes after resume")
      assert.are.equal(50, generated)
      assert.are.equal(50, done.generated)
      assert.are.equal("length", done.finish)
      assert.is_true(client:close())
    end)
  end)

  it("answers an unknown command with UNKNOWN_COMMAND and stays usable", function()
    run_async(function()
      local client = spawn()
      local err = raised(client.request, client, "levitate")
      assert.are.equal("RUNTIME_COMMAND_FAILED", err.code)
      assert.are.equal("UNKNOWN_COMMAND", err.remote_code)
      assert.matches("does not know the command 'levitate'", err.message, 1, true)
      assert.are.equal("IDLE", client.state)
      assert.are.equal("reference", client:request("info").runtime)
      assert.is_true(client:close())
    end)
  end)

  it("refuses a second request while one is in flight, without breaking", function()
    run_async(function()
      local client = spawn()
      local first = async.start(function()
        return client:request("checksum")
      end)
      assert.are.equal("INFLIGHT", client.state)
      local err = raised(client.request, client, "info")
      assert.are.equal("string", type(err))
      assert.matches("info requested while checksum is in flight (one request at a time)", err, 1, true)
      local misuse = raised(client.close, client)
      assert.matches("close() while checksum is in flight", misuse, 1, true)
      local ok, result = first()
      assert.is_true(ok)
      assert.are.equal(2, #result.workers)
      assert.are.equal("IDLE", client.state)
      assert.are.equal(2, client:request("info").tp_world)
      assert.is_true(client:close())
    end)
  end)

  it("shuts down politely on close: exit code 0, group empty, later requests refused", function()
    run_async(function()
      local client = spawn()
      local pids = worker_pids(client:request("info"))
      assert.is_true(client:close())
      assert.are.equal("CLOSED", client.state)
      assert.are.same({ code = 0, signal = 0 }, client.exit_status)
      assert_tree_gone(client, pids)
      assert.is_nil(client.cause)
      local err = raised(client.request, client, "info")
      assert.are.equal("RUNTIME_CLOSED", err.code)
      assert.matches("is closed", err.message, 1, true)
      assert.is_true(client:close(), "a second close is harmless")
    end)
  end)

  it("breaks when a worker is killed from outside, naming the worker", function()
    run_async(function()
      local client = spawn()
      local pids = worker_pids(client:request("info"))
      assert(uv.kill(pids[2], "sigkill"))
      -- The main process reaps its worker; then give it a moment to read the EOF.
      wait_until(function()
        return not exists(pids[2])
      end, 5000, "worker 1 is reaped")
      loop.sleep(50)
      assert.are.equal("IDLE", client.state, "the host has not asked anything yet")
      local err = raised(client.request, client, "info")
      assert.are.equal("RUNTIME_BROKEN", err.code)
      assert.matches("WORKER_DIED", err.message, 1, true)
      assert.matches("TP worker 1 %(pid " .. pids[2] .. "%) broken", err.message)
      assert.are.equal("BROKEN", client.state)
      client:wait_dead()
      assert_tree_gone(client, pids)
      assert.are.equal(err, raised(client.request, client, "info"), "later requests fail with the same cause")
    end)
  end)

  it("breaks when its main process is killed from outside while idle", function()
    run_async(function()
      local client = spawn()
      local pids = worker_pids(client:request("info"))
      assert(uv.kill(client.pid, "sigkill"))
      client:wait_dead()
      assert.are.equal("BROKEN", client.state)
      assert_tree_gone(client, pids)
      local err = raised(client.request, client, "info")
      assert.are.equal("RUNTIME_BROKEN", err.code)
      local names_it = err.message:find("EOF", 1, true) or err.message:find("exited (signal 9)", 1, true)
      assert.is_truthy(names_it, err.message)
      assert.are.same({ code = 0, signal = 9 }, client.exit_status)
      local ok, cause = client:close()
      assert.is_nil(ok)
      assert.are.equal(err, cause)
    end)
  end)

  -- In a process of its own: a host killed by SIGPIPE would end this one.
  it("survives a request written to a runtime that died unnoticed (no SIGPIPE)", function()
    local chunk = [[
      local loop = require("wsync.loop")
      local uv = require("luv")
      loop.spawn(function()
        local client = require("wsync.runtime").spawn({ tp = 1, weights_bytes = 4096, kv_bytes = 4096 })
        assert(uv.kill(client.pid, "sigkill"))
        -- Wait, without running the loop, until the runtime is a zombie: its
        -- end of the channel is closed and the host has not noticed.
        for _ = 1, 5000 do
          local stat = io.open("/proc/" .. client.pid .. "/stat"):read("*a")
          if stat:match("%) Z ") then
            break
          end
          uv.sleep(1)
        end
        local ok, err = pcall(client.request, client, "info")
        assert(not ok)
        io.stdout:write(err.code, ": ", err.message, "\n")
        client:wait_dead()
      end)
      loop.run()
    ]]
    local result = process_helper.wsync({ "-e", chunk })
    assert.are.equal(0, result.code, "exit " .. result.code .. " (141 is SIGPIPE): " .. result.stderr)
    assert.matches("^RUNTIME_BROKEN: reference runtime broken during info: the control channel closed %(EOF%)",
      result.stdout)
  end)

  it("refuses another protocol version at the first frame and exits", function()
    -- (As a client does: the runtime's orphaned worker comes back here.)
    local hold = subreaper.hold()
    finally(function()
      hold:release()
    end)
    run_async(function()
      local pipe = uv.new_pipe(false)
      local exited = nil
      local handle, pid
      handle, pid = uv.spawn(process_helper.wsync_binary(), {
        args = { "runtime", "--tp", "1" },
        stdio = { nil, 1, 2, pipe },
        detached = true, -- its own group, so that /proc tells when the tree is gone
      }, function(code, signal)
        exited = { code = code, signal = signal }
        handle:close()
      end)
      assert(handle, pid)
      local answers, closes = {}, {}
      local raw = channel.new(pipe, {
        on_message = function(message)
          answers[#answers + 1] = message
        end,
        on_close = function(reason)
          closes[#closes + 1] = reason
        end,
      })
      local request = protocol.request(1, "info")
      request.protocol = protocol.VERSION + 1
      assert(raw:send(request))
      local answered, failure = pcall(wait_until, function()
        return exited ~= nil and #closes > 0
      end, 10000, "the runtime answers and exits")
      if not answered then -- end it anyway, then report
        process.signal_group(pid, "SIGKILL")
        wait_until(function()
          return exited ~= nil
        end, 5000, "the runtime dies")
        raw:close()
      end
      -- Its worker may outlive it for a moment: it comes back to this
      -- process (a subreaper) to be reaped.
      wait_until(function()
        process.reap_group(pid)
        return process.count_group(pid) == 0
      end, 5000, "the runtime's group is empty")
      assert(answered, failure)
      assert.are.equal(1, #answers)
      local answer = answers[1]
      assert.are.equal(false, answer.ok)
      assert.are.equal(protocol.VERSION, answer.protocol)
      assert.are.equal(1, answer.id)
      assert.are.equal("info", answer.cmd)
      assert.are.equal("PROTOCOL_MISMATCH", answer.error.code)
      assert.matches("peer speaks protocol 2, this side speaks 1", answer.error.message, 1, true)
      assert.are.same({ "EOF" }, closes)
      assert.are.same({ code = 0, signal = 0 }, exited)
    end)
  end)

  describe("`wsync runtime` on the command line", function()
    local usage = {
      { "no --tp", {}, "wsync runtime needs --tp N (N >= 1)" },
      { "--tp 0", { "--tp", "0" }, "wsync runtime needs --tp N (N >= 1)" },
      { "a word for --tp", { "--tp", "two" }, "--tp needs a non-negative integer, got 'two'" },
      { "an option without its value", { "--tp" }, "--tp needs a value" },
      { "an unknown option", { "--tp", "1", "--color", "red" }, "unexpected argument '--color'" },
      { "more devices than ranks", { "--tp", "2", "--devices", "0,1,2" }, "--devices names 3 devices for --tp 2" },
      { "a bad device index", { "--tp", "1", "--devices", "gpu0" }, "--devices takes device indices, got 'gpu0'" },
    }
    for _, case in ipairs(usage) do
      it("exits 2 with a message on " .. case[1], function()
        local args = { "runtime" }
        for _, word in ipairs(case[2]) do
          args[#args + 1] = word
        end
        local result = process_helper.wsync(args)
        assert.are.equal(2, result.code, result.stderr)
        assert.matches(case[3], result.stderr, 1, true)
        assert.are.equal("", result.stdout)
      end)
    end

    it("exits 1 with a message when started without the host's channel", function()
      local result = process_helper.wsync({ "runtime", "--tp", "2" })
      assert.are.equal(1, result.code, result.stderr)
      assert.matches("no control channel on fd 3", result.stderr, 1, true)
    end)

    it("a TP worker whose starter is not its parent any more refuses to run", function()
      -- WSYNC_PARENT_PID names the process that spawned it; here that is not
      -- the worker's parent, as if the spawner had died before the worker
      -- could ask to die with it.
      local result = process_helper.run({
        args = { "runtime-worker", "--rank", "0", "--world", "1", "--device", "0", "--weights-bytes", "1",
          "--kv-bytes", "1" },
        env = { "WSYNC_PARENT_PID=1" },
      })
      assert.are.equal(1, result.code, result.stderr)
      assert.matches("the process that started this one is gone", result.stderr, 1, true)
    end)
  end)
end)
