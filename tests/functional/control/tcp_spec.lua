-- Trainer ranks on other "hosts": the control endpoint over TCP, the ranks in
-- a network namespace of their own joined to the host's by a veth pair that
-- the test makes (traffic only between the two namespaces' addresses). The
-- host backend's buffers are in /dev/shm, which both namespaces see (one
-- node: the data plane stays local). Cases: a two-"host" publication, a
-- connection with a wrong token, and a rank whose link is cut between
-- publications. Pending where this machine cannot make network namespaces
-- (it takes root and iproute2's `ip netns`).
local uv = require("luv")
local process = require("tests.helpers.process")

local RECIPE = "tests/fixtures/recipes/tcp_external.lua"

-- Runs `ip ARGS...`; returns true, or nil and what it printed.
local function ip(...)
  local result = process.run({ program = "ip", args = { ... }, timeout = 10000 })
  if result.code ~= 0 then
    return nil, result.stderr .. result.stdout
  end
  return true
end

-- Two namespaces (host side 10.W.X.1, ranks' side 10.W.X.2) joined by a
-- veth pair, or nil and why not.
local function make_namespaces()
  local tag = string.format("%d%d", uv.os_getpid() % 10000, math.random(10, 99))
  local net = { host = "wsync-h" .. tag, ranks = "wsync-t" .. tag, host_if = "wvh" .. tag, ranks_if = "wvt" .. tag,
    host_ip = string.format("10.%d.%d.1", 77 + uv.os_getpid() % 100, tag % 250),
    ranks_ip = string.format("10.%d.%d.2", 77 + uv.os_getpid() % 100, tag % 250) }
  local steps = {
    { "netns", "add", net.host }, { "netns", "add", net.ranks },
    { "link", "add", net.host_if, "type", "veth", "peer", "name", net.ranks_if },
    { "link", "set", net.host_if, "netns", net.host }, { "link", "set", net.ranks_if, "netns", net.ranks },
    { "-n", net.host, "addr", "add", net.host_ip .. "/24", "dev", net.host_if },
    { "-n", net.ranks, "addr", "add", net.ranks_ip .. "/24", "dev", net.ranks_if },
    { "-n", net.host, "link", "set", net.host_if, "up" }, { "-n", net.ranks, "link", "set", net.ranks_if, "up" },
    { "-n", net.host, "link", "set", "lo", "up" }, { "-n", net.ranks, "link", "set", "lo", "up" },
  }
  for _, step in ipairs(steps) do
    local ok, why = ip(unpack(step))
    if not ok then
      ip("netns", "del", net.host)
      ip("netns", "del", net.ranks)
      return nil, string.format("`ip %s` failed: %s", table.concat(step, " "), why)
    end
  end
  return net
end

local function remove_namespaces(net)
  ip("netns", "del", net.host)
  ip("netns", "del", net.ranks)
end

-- `wsync ARGS` inside namespace `ns`.
local function in_namespace(ns, args, env)
  local full = { "netns", "exec", ns, process.wsync_binary() }
  for _, arg in ipairs(args) do
    full[#full + 1] = arg
  end
  return process.start("ip", full, env)
end

local net, why = make_namespaces()

describe("trainer ranks in another network namespace, over the TCP control endpoint", function()
  if not net then
    pending("this machine cannot make network namespaces: " .. tostring(why))
    return
  end
  teardown(function()
    remove_namespaces(net)
  end)

  -- Starts the host in its namespace; returns it and the endpoint it prints.
  local function start_host(extra_env)
    local env = { "WSYNC_TEST_TCP=" .. net.host_ip .. ":0" }
    for _, entry in ipairs(extra_env or {}) do
      env[#env + 1] = entry
    end
    local host = in_namespace(net.host, { "run", RECIPE }, env)
    process.drive(function()
      return host.stdout:match("control endpoint for other hosts (tcp://%S+)") ~= nil or host.done
    end, 20000, "the host prints its TCP endpoint")
    local endpoint = host.stdout:match("control endpoint for other hosts (tcp://%S+)")
    assert.is_not_nil(endpoint, host.stdout .. host.stderr)
    assert.matches("^tcp://" .. net.host_ip:gsub("%.", "%%.") .. ":%d+%?token=%x+$", endpoint)
    return host, endpoint
  end

  local function rank(endpoint, r, versions)
    return in_namespace(net.ranks, { "trainer", "--endpoint", endpoint, "--rank", tostring(r), "--world", "2",
      "--model", "tiny", "--versions", tostring(versions or 3) })
  end

  it("publishes from two ranks in the other namespace, refusing a connection with a wrong token first", function()
    local host, endpoint = start_host()
    local impostor = rank(endpoint:gsub("token=%x+", "token=" .. string.rep("0", 32)), 0)
    process.drive(function()
      return impostor.done
    end, 20000, "the connection with a wrong token ends")
    assert.are_not.equal(0, impostor.code)
    assert.matches("refused: this session's endpoint takes connections over TCP with its token only",
      impostor.stderr, 1, true)
    local ranks = { rank(endpoint, 0), rank(endpoint, 1) }
    process.drive(function()
      return host.done and ranks[1].done and ranks[2].done
    end, 60000, "the session ends")
    assert.are.equal(0, host.code, host.stdout .. host.stderr)
    assert.matches("refused agent at " .. net.ranks_ip .. ":%d+: a wrong token", host.stdout)
    assert.matches("verdict: OK: 3 model versions published, every resident TP slice verified", host.stdout, 1, true)
    for r = 1, 2 do
      assert.are.equal(0, ranks[r].code, ranks[r].stderr)
      assert.matches("published model version 3", ranks[r].stdout, 1, true)
    end
  end)

  it("fails fail-stop, naming the rank, when the ranks' link is cut during their publications", function()
    -- (Many publications, so that the cut lands while they run.)
    local host, endpoint = start_host({ "WSYNC_TEST_STEPS=100000" })
    local ranks = { rank(endpoint, 0, 100000), rank(endpoint, 1, 100000) }
    process.drive(function()
      return ranks[1].stdout:find("published model version 1", 1, true) ~= nil or host.done
    end, 30000, "the first publication")
    assert(ip("-n", net.ranks, "link", "set", net.ranks_if, "down"))
    process.drive(function()
      return host.done
    end, 60000, "the host gives up on the unreachable ranks")
    assert(ip("-n", net.ranks, "link", "set", net.ranks_if, "up"))
    for r = 1, 2 do
      process.finish(ranks[r])
    end
    assert.are_not.equal(0, host.code)
    local verdict = host.stdout:match("\nwsync: verdict: FAILED: ([^\n]*)")
    assert.is_not_nil(verdict, host.stdout)
    assert.is_nil(host.stdout:find("published model version 100000", 1, true))
    assert.matches("rank %d", verdict)
    -- Given up within the recipe's 5 s timeouts, and everything local is gone.
    assert.is_nil(host.stdout:find("verdict: OK", 1, true))
  end)
end)
