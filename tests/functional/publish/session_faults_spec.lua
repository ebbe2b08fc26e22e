-- A session's trainer ranks misbehaving, seen from the ranks' side: `wsync run`
-- on a recipe with external trainer ranks (the host waits on its control
-- endpoint), ranks that are `wsync trainer` processes, and raw connections
-- made by this test: a rank that dies before its first publish, a rank that
-- dies while the others register and comes back, a malformed message from a
-- connection that registered no rank and from one that did, bytes that are
-- no frame, a 4 GB length prefix, and a host killed with SIGKILL whose
-- control directory the next host removes.
local uv = require("luv")
local leftovers = require("tests.helpers.leftovers")
local process = require("tests.helpers.process")
local channel_module = require("wsync.control.channel")
local device = require("wsync.native.device")
local peer_module = require("wsync.control.peer")
local qwen3_moe = require("wsync.plan.qwen3_moe")
local trainer = require("wsync.trainer.synthetic")

local RECIPE = "tests/fixtures/recipes/external_tiny.lua"
local WORLD = 2

-- Processes the running test started; after_each ends whatever is left.
local started = {}
local tmpdir = nil
local mark = nil

local function start(args, env)
  local all_env = { mark, "TMPDIR=" .. tmpdir }
  for _, entry in ipairs(env or {}) do
    all_env[#all_env + 1] = entry
  end
  local proc = process.start(process.wsync_binary(), args, all_env)
  started[#started + 1] = proc
  return proc
end

local function describe_proc(proc)
  return string.format("%s (pid %d) exited %s/%s\nstdout:\n%s\nstderr:\n%s", proc.program, proc.pid,
    tostring(proc.code), tostring(proc.signal), proc.stdout, proc.stderr)
end

-- The host on `recipe` (default the external fixture); returns it and the
-- endpoint it printed.
local function start_host(recipe)
  local host = start({ "run", recipe or RECIPE })
  local endpoint = nil
  process.drive(function()
    endpoint = host.stdout:match("waiting for %d+ external trainer ranks on (%S+)\n")
    return endpoint ~= nil or host.done
  end, 30000, "the host's endpoint")
  assert(endpoint, "the host did not print its endpoint: " .. describe_proc(host))
  return host, endpoint
end

-- A synthetic trainer rank on `endpoint` (three versions, the demo's model).
local function start_rank(endpoint, rank, env)
  return start({ "trainer", "--endpoint", endpoint, "--rank", tostring(rank), "--world", tostring(WORLD),
    "--model", "tiny", "--versions", "3" }, env)
end

local function wait_all(ms)
  process.drive(function()
    for _, proc in ipairs(started) do
      if not proc.done then
        return false
      end
    end
    return true
  end, ms or 60000, "every process of the session to exit")
end

local function verdict(host)
  return host.stdout:match("\nwsync: verdict: ([^\n]*)\n")
end

-- A pipe connected to `endpoint`.
local function connect(endpoint)
  local pipe = uv.new_pipe(false)
  local connected = nil
  pipe:connect(endpoint, function(err)
    connected = err or true
  end)
  process.drive(function()
    return connected ~= nil
  end, 5000, "the connection to " .. endpoint)
  assert(connected == true, tostring(connected))
  return pipe
end

local in_coroutine = process.in_coroutine

-- A peer (this process as a trainer agent) connected to `endpoint`.
local function agent_peer(endpoint)
  return peer_module.new(connect(endpoint), { name = "host" })
end

-- A connection to `endpoint` from this process that sends raw bytes;
-- `closed` holds the reason once it ends.
local function raw_connection(endpoint)
  local connection = { received = {} }
  connection.channel = channel_module.new(connect(endpoint), {
    on_message = function(message)
      connection.received[#connection.received + 1] = message
    end,
    on_close = function(reason)
      connection.closed = reason
    end,
  })
  return connection
end

-- What rank `rank` of the tiny model registers (as the synthetic trainer).
local function registration(rank)
  local family = qwen3_moe
  local layout = family.trainer_layout(family.config("tiny"))
  local shards = trainer.shards(layout, WORLD, rank, family.shard_rows)
  local tensors = {}
  for index, shard in ipairs(shards.tensors) do
    tensors[index] = { name = shard.name, dtype = shard.dtype, shape = shard.shape, rows = shard.rows }
  end
  local info = assert(device.query("host", rank))
  return {
    rank = rank, world = WORLD, tensors = tensors, hostname = uv.os_gethostname(), pid = uv.os_getpid(),
    device = { backend = "host", index = info.index, uuid = info.uuid, free_bytes = info.free_bytes },
    callbacks = { "offload_actor", "offload_optimizer", "onload_actor", "onload_optimizer" },
  }
end

describe("a session's trainer ranks", function()
  before_each(function()
    tmpdir = assert(uv.fs_mkdtemp((os.getenv("TMPDIR") or "/tmp") .. "/wsync-test-XXXXXX"))
    mark = string.format("WSYNC_SESSION_FAULTS_SPEC=%d-%d", uv.os_getpid(), uv.hrtime())
  end)

  after_each(function()
    local left = started
    started = {}
    for _, proc in ipairs(left) do
      process.finish(proc)
    end
    -- Nothing of the session outlives it: no process, no file in its TMPDIR.
    local deadline = uv.hrtime() + 2e9
    while #leftovers.with_environment(mark) > 0 and uv.hrtime() < deadline do
      uv.sleep(10)
    end
    local live = leftovers.with_environment(mark)
    for _, pid in ipairs(live) do
      uv.kill(pid, "sigkill")
    end
    local files = {}
    local scanner = uv.fs_scandir(tmpdir)
    while scanner do
      local name = uv.fs_scandir_next(scanner)
      if not name then
        break
      end
      files[#files + 1] = name
      uv.fs_unlink(tmpdir .. "/" .. name .. "/control.sock")
      uv.fs_rmdir(tmpdir .. "/" .. name)
    end
    uv.fs_rmdir(tmpdir)
    assert.are.same({}, live, "processes of the session outlived it")
    assert.are.same({}, files, "files left in the session's TMPDIR")
  end)

  it("fail the session when one dies before its first publish: non-zero, naming the rank and the phase", function()
    local host, endpoint = start_host()
    local survivor = start_rank(endpoint, 0)
    local dying = start_rank(endpoint, 1, { "WSYNC_TRAINER_FAULT=die@publish#1" })
    wait_all()
    assert.are.equal(1, host.code, describe_proc(host))
    assert.are.equal(9, dying.signal, describe_proc(dying))
    local failure = verdict(host):match("^FAILED: (.*)$")
    assert.matches("^%[phase waiting for publish, rank 1%] trainer rank 1 was lost during waiting for publish: "
      .. "agent pid " .. dying.pid .. " closed the connection$", failure)
    -- The other rank's publish raised the very error, however it came.
    assert.are.equal(1, survivor.code, describe_proc(survivor))
    assert.are.equal("wsync: " .. failure .. "\n", survivor.stderr)
    assert.is_nil(host.stdout:find("published model version", 1, true))
  end)

  it("refuse a rank back after it was lost while the others registered: the session fails at the loss", function()
    local host, endpoint = start_host()
    local first = start_rank(endpoint, 1)
    process.drive(function()
      return host.stdout:find("trainer rank 1 registered", 1, true) ~= nil
    end, 20000, "rank 1's registration")
    first.handle:kill("sigkill")
    process.drive(function()
      return first.done
    end, 5000, "rank 1's death")
    local again = start_rank(endpoint, 1)
    local other = start_rank(endpoint, 0)
    wait_all()
    assert.are.equal(1, host.code, describe_proc(host))
    assert.matches("^FAILED: %[phase registration, rank 1%] trainer rank 1 was lost during registration: agent pid "
      .. first.pid .. " closed the connection$", verdict(host))
    -- Neither the rank that came back nor the other one got a session.
    assert.are_not.equal(0, again.code, describe_proc(again))
    assert.are_not.equal(0, other.code, describe_proc(other))
    assert.is_nil(again.stdout:find("published", 1, true))
    assert.is_nil(host.stdout:find("starting the reference runtime", 1, true), "a runtime was started")
    -- The closing report says where the time went: registration, no runtime.
    assert.matches("\nwsync:     opening [%d.]+ s: plan [%d.]+ s, listen [%d.]+ s, registration [%d.]+ s %(failed%)\n",
      host.stdout)
  end)

  it("drop a connection that sends a malformed register, random bytes or a 4 GB frame, and go on serving",
    function()
      local host, endpoint = start_host()
      local peer = agent_peer(endpoint)
      local bad = registration(0)
      bad.device = nil
      local ok, err = in_coroutine(function()
        return pcall(peer.request, peer, "register", bad, 10)
      end)
      assert.is_false(ok)
      assert.are.equal("BAD_MESSAGE", err.code)
      assert.are.equal("register: field 'device': is required", err.message)
      process.drive(function()
        return peer.closed
      end, 5000, "the host to drop the connection")

      local garbage = raw_connection(endpoint)
      garbage.channel:send_raw("\0\0\0\12not a frame!")
      local huge = raw_connection(endpoint)
      huge.channel:send_raw("\255\255\255\255{")
      process.drive(function()
        return garbage.closed ~= nil and huge.closed ~= nil
      end, 10000, "the host to drop the connections")

      -- The session goes on: two ranks publish their three versions.
      start_rank(endpoint, 0)
      start_rank(endpoint, 1)
      wait_all()
      assert.are.equal(0, host.code, describe_proc(host))
      assert.matches("^OK: 3 model versions published", verdict(host))
      local own = "agent pid " .. uv.os_getpid()
      assert.matches("\nwsync: dropped the connection of " .. own .. ": malformed request: register: field "
        .. "'device': is required\n", host.stdout, 1, true)
      assert.matches("\nwsync: dropped the connection of " .. own .. ": undecodable frame: ", host.stdout, 1, true)
      assert.matches("\nwsync: dropped the connection of " .. own .. ": frame of 4294967295 bytes exceeds the "
        .. "16777216-byte limit\n", host.stdout, 1, true)
    end)

  it("fail the session, naming the rank, when a registered rank sends a malformed message", function()
    local host, endpoint = start_host()
    local other = start_rank(endpoint, 0)
    local peer = agent_peer(endpoint)
    local ok, err = in_coroutine(function()
      peer:request("register", registration(1), 30)
      return pcall(peer.request, peer, "publish", { step = "one" }, 10)
    end)
    peer:close()
    assert.is_false(ok)
    assert.are.equal("BAD_MESSAGE", err.code)
    assert.matches("^publish: field 'step': expected a number", err.message)
    wait_all()
    assert.are.equal(1, host.code, describe_proc(host))
    local failure = verdict(host):match("^FAILED: (.*)$")
    assert.matches("^%[phase waiting for publish, rank 1%] trainer rank 1 %(agent pid " .. uv.os_getpid()
      .. "%) sent a malformed request: publish: field 'step': expected a number, got \"one\"$", failure)
    assert.are.equal(1, other.code, describe_proc(other))
    assert.are.equal("wsync: " .. failure .. "\n", other.stderr)
  end)

  it("of a host killed with SIGKILL: the next host removes the control directory it left", function()
    local killed = start_host()
    killed.handle:kill("sigkill")
    process.drive(function()
      return killed.done
    end, 5000, "the killed host")
    local left = string.format("%s/wsync-%d-", tmpdir, killed.pid)
    local scanner = uv.fs_scandir(tmpdir)
    local name = scanner and uv.fs_scandir_next(scanner)
    assert.is_string(name, "the killed host left no directory: the test proves nothing")
    assert.are.equal(left, (tmpdir .. "/" .. name):sub(1, #left))

    local host = start_host()
    assert.matches("\nwsync: removed " .. tmpdir .. "/" .. name .. ", left by host pid " .. killed.pid
      .. ", which is gone\n", "\n" .. host.stdout, 1, true)
    assert.is_nil(uv.fs_stat(tmpdir .. "/" .. name), "the directory is still there")
    host.handle:kill("sigint")
    wait_all()
    assert.are.equal(130, host.code, describe_proc(host))
  end)
end)
