-- Launching trainer ranks the way torchrun does: the endpoint fixed before the
-- host starts (the recipe's control.endpoint, here from the command line),
-- every rank finding it in $WSYNC_ENDPOINT; over TCP, a token the launcher
-- hands to the host and the ranks in the environment, never printed; and a
-- rank the host refuses hears the host's reason.
local uv = require("luv")
local process = require("tests.helpers.process")

local RECIPE = "tests/fixtures/recipes/external_tiny.lua"
local TOKEN = "0123456789abcdef0123456789abcdef"

-- A fresh directory for the test's socket; removed by `cleanup`.
local function scratch()
  return assert(uv.fs_mkdtemp((os.getenv("TMPDIR") or "/tmp") .. "/wsync-launch-XXXXXX"))
end

-- Starts the synthetic trainer ranks 0 .. world-1 with `env`, their endpoint
-- left to the environment.
local function start_ranks(world, env)
  local ranks = {}
  for rank = 0, world - 1 do
    ranks[rank + 1] = process.start(process.wsync_binary(), { "trainer", "--rank", tostring(rank), "--world",
      tostring(world), "--model", "tiny", "--versions", "3" }, env)
  end
  return ranks
end

-- Waits for every process of `procs` to end (60 s at most).
local function wait_all(procs)
  process.drive(function()
    for _, proc in ipairs(procs) do
      if not proc.done then
        return false
      end
    end
    return true
  end, 60000, "the session to end")
end

local function finish_all(procs)
  for _, proc in ipairs(procs) do
    process.finish(proc)
  end
end

describe("a launcher's ranks", function()
  it("find a fixed unix endpoint in $WSYNC_ENDPOINT", function()
    local directory = scratch()
    local path = directory .. "/wsync.sock"
    local host = process.start(process.wsync_binary(), { "run", RECIPE, "control.endpoint=" .. path })
    local procs = { host }
    local ok, err = pcall(function()
      process.drive(function()
        return host.stdout:find("waiting for 2 external trainer ranks", 1, true) ~= nil or host.done
      end, 20000, "the host to wait for its ranks")
      assert.matches("wsync: control endpoint " .. path .. "\n", host.stdout, 1, true)
      for _, rank in ipairs(start_ranks(2, { "WSYNC_ENDPOINT=" .. path })) do
        procs[#procs + 1] = rank
      end
      wait_all(procs)
      assert.are.equal(0, host.code, host.stdout .. host.stderr)
      assert.matches("verdict: OK: 3 model versions published", host.stdout, 1, true)
      for index = 2, 3 do
        assert.are.equal(0, procs[index].code, procs[index].stderr)
      end
      assert.is_nil(uv.fs_stat(path), "the host removed its socket")
    end)
    finish_all(procs)
    os.remove(path)
    uv.fs_rmdir(directory)
    assert(ok, err)
  end)

  it("over TCP, prove a token the launcher gave the host and the ranks, which the host does not print", function()
    local host = process.start(process.wsync_binary(), { "run", RECIPE, "control.tcp=127.0.0.1:0",
      "control.token_env=LAUNCH_TOKEN" }, { "LAUNCH_TOKEN=" .. TOKEN })
    local procs = { host }
    local ok, err = pcall(function()
      process.drive(function()
        return host.stdout:find("waiting for 2 external trainer ranks", 1, true) ~= nil or host.done
      end, 20000, "the host to wait for its ranks")
      local address = host.stdout:match("control endpoint for other hosts (tcp://[%d.:]+) %(its token is in "
        .. "%$LAUNCH_TOKEN%)\n")
      assert.is_not_nil(address, host.stdout .. host.stderr)
      -- A rank without the token is told where to find it.
      local lost = process.wsync({ "trainer", "--rank", "0", "--world", "2", "--model", "tiny" },
        nil, { env = { "WSYNC_ENDPOINT=" .. address } })
      assert.are.equal(1, lost.code)
      assert.matches("carries no token, and neither WSYNC_TOKEN nor WSYNC_TOKEN_FILE is set", lost.stderr, 1, true)
      -- Rank 0 has the token itself, rank 1 a file that holds it.
      local token_file = os.tmpname()
      local file = assert(io.open(token_file, "w"))
      file:write(TOKEN, "\n")
      file:close()
      for rank, env in ipairs({ "WSYNC_TOKEN=" .. TOKEN, "WSYNC_TOKEN_FILE=" .. token_file }) do
        procs[#procs + 1] = process.start(process.wsync_binary(), { "trainer", "--rank", tostring(rank - 1), "--world",
          "2", "--model", "tiny", "--versions", "3" }, { "WSYNC_ENDPOINT=" .. address, env })
      end
      wait_all(procs)
      os.remove(token_file)
      assert.are.equal(0, host.code, host.stdout .. host.stderr)
      assert.matches("verdict: OK: 3 model versions published", host.stdout, 1, true)
      assert.is_nil((host.stdout .. host.stderr):find(TOKEN, 1, true), "the host printed the token")
    end)
    finish_all(procs)
    assert(ok, err)
  end)

  it("learns the host's reason when it registers a tensor of the wrong shape, before the runtime starts", function()
    local directory = scratch()
    local path = directory .. "/wsync.sock"
    local host = process.start(process.wsync_binary(), { "run", RECIPE, "control.endpoint=" .. path })
    local procs = { host }
    local ok, err = pcall(function()
      process.drive(function()
        return host.stdout:find("waiting for 2 external trainer ranks", 1, true) ~= nil or host.done
      end, 20000, "the host to wait for its ranks")
      -- (Rank 0 first: it waits in ready() when rank 1's registration fails
      -- the session.)
      local env = { "WSYNC_ENDPOINT=" .. path, "WSYNC_TRAINER_FAULT=rank1:drop_expert" }
      procs[2] = process.start(process.wsync_binary(), { "trainer", "--rank", "0", "--world", "2", "--model", "tiny" },
        env)
      process.drive(function()
        return host.stdout:find("trainer rank 0 registered", 1, true) ~= nil or host.done
      end, 20000, "rank 0 to register")
      procs[3] = process.start(process.wsync_binary(), { "trainer", "--rank", "1", "--world", "2", "--model", "tiny" },
        env)
      wait_all(procs)
      local reason = "[phase registration, rank 1] trainer rank 1 registered model.layers.0.mlp.experts.gate_up_proj "
        .. "as bfloat16 3x64x64; the model config says bfloat16 4x64x64"
      assert.are.equal(1, host.code)
      assert.matches("verdict: FAILED: " .. reason, host.stdout, 1, true)
      assert.is_nil(host.stdout:find("starting the reference runtime", 1, true), "the runtime did not start")
      for index = 2, 3 do
        assert.are.equal(1, procs[index].code)
        assert.are.equal("wsync: " .. reason .. "\n", procs[index].stderr)
      end
    end)
    finish_all(procs)
    os.remove(path)
    uv.fs_rmdir(directory)
    assert(ok, err)
  end)

  it("learns the host's reason when the others do not come in time", function()
    local directory = scratch()
    local path = directory .. "/wsync.sock"
    local host = process.start(process.wsync_binary(), { "run", RECIPE, "control.endpoint=" .. path,
      "timeouts.registration=3" })
    local procs = { host }
    local ok, err = pcall(function()
      process.drive(function()
        return host.stdout:find("waiting for 2 external trainer ranks", 1, true) ~= nil or host.done
      end, 20000, "the host to wait for its ranks")
      procs[2] = process.start(process.wsync_binary(), { "trainer", "--rank", "0", "--world", "2", "--model", "tiny" },
        { "WSYNC_ENDPOINT=" .. path })
      wait_all(procs)
      assert.are.equal(1, host.code)
      assert.are.equal(1, procs[2].code)
      assert.are.equal("wsync: 1 of 2 trainer ranks registered within 3 s (timeouts.registration)\n",
        procs[2].stderr)
    end)
    finish_all(procs)
    os.remove(path)
    uv.fs_rmdir(directory)
    assert(ok, err)
  end)

  it("cannot take a fixed endpoint that a live host listens on; one a dead host left is taken", function()
    local directory = scratch()
    local path = directory .. "/wsync.sock"
    -- A socket file whose socket is closed: what a host killed with SIGKILL
    -- leaves. (Closing a bound pipe unlinks its path: move it away first.)
    local bound = directory .. "/bound.sock"
    local stale = uv.new_pipe(false)
    assert(stale:bind(bound))
    assert(os.rename(bound, path))
    stale:close()
    uv.run("nowait")
    local host = process.start(process.wsync_binary(), { "run", RECIPE, "control.endpoint=" .. path })
    local procs = { host }
    local ok, err = pcall(function()
      process.drive(function()
        return host.stdout:find("waiting for 2 external trainer ranks", 1, true) ~= nil or host.done
      end, 20000, "the host to wait for its ranks")
      local second = process.wsync({ "run", RECIPE, "control.endpoint=" .. path }, nil, { timeout = 20000 })
      assert.are.equal(1, second.code)
      -- (Printed once, in its verdict.)
      assert.matches("\nwsync: verdict: FAILED: cannot listen on " .. path .. ": another host listens there\n",
        second.stdout, 1, true)
      assert.are.equal("", second.stderr)
      host.handle:kill("sigterm")
      wait_all(procs)
    end)
    finish_all(procs)
    os.remove(path)
    uv.fs_rmdir(directory)
    assert(ok, err)
  end)
end)
