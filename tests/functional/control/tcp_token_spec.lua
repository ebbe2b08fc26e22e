-- A host whose control endpoint listens on TCP (loopback), facing clients
-- that do not have the session's token: they get one refusal and are closed,
-- the host prints a line for each, its memory does not grow with what they
-- send, and afterwards it serves real trainer ranks over TCP.
local uv = require("luv")
local channel_module = require("wsync.control.channel")
local loop = require("wsync.loop")
local process = require("tests.helpers.process")
local protocol = require("wsync.control.protocol")

local RECIPE = "tests/fixtures/recipes/tcp_external.lua"

-- The resident set of process `pid`, in KiB.
local function rss_kib(pid)
  local file = assert(io.open(string.format("/proc/%d/status", pid)))
  local status = file:read("*a")
  file:close()
  return tonumber(status:match("VmRSS:%s*(%d+) kB"))
end

-- A bare TCP client of the host at `port` (inside a coroutine): a channel
-- recording what the host sends and why the connection ended.
local function connect(port)
  local tcp = uv.new_tcp()
  local ok, err = loop.await(function(resume)
    tcp:connect("127.0.0.1", port, function(connect_error)
      resume(connect_error == nil, connect_error)
    end)
  end)
  assert(ok, err)
  local client = { messages = {}, closed = nil }
  client.channel = channel_module.new(tcp, {
    on_message = function(message)
      client.messages[#client.messages + 1] = message
    end,
    on_close = function(reason)
      client.closed = reason
    end,
  })
  return client
end

describe("the TCP control endpoint, to clients without the token", function()
  it("refuses them, holds nothing of their large frames, then serves ranks over TCP", function()
    local host = process.start(process.wsync_binary(), { "run", RECIPE }, { "WSYNC_TEST_TCP=127.0.0.1:0" })
    local clients, ranks = {}, {}
    local ok, err = pcall(function()
      process.drive(function()
        return host.stdout:find("waiting for 2 external trainer ranks", 1, true) ~= nil or host.done
      end, 20000, "the host to wait for its ranks")
      local endpoint = host.stdout:match("control endpoint for other hosts (tcp://%S+)")
      assert.is_not_nil(endpoint, host.stdout .. host.stderr)
      local port = tonumber(endpoint:match(":(%d+)%?token="))
      local before = rss_kib(host.pid)
      -- Eight clients each announce a 16 MiB frame and send 4 MiB of it
      -- (random bytes: the old host held each client's 4 MiB).
      local count, sent = 8, 4 * 1024 * 1024
      local grown = process.in_coroutine(function()
        local random = assert(io.open("/dev/urandom", "rb"))
        local written = 0
        for index = 1, count do
          clients[index] = connect(port)
          clients[index].channel.stream:write("\1\0\0\0" .. random:read(sent), function()
            written = written + 1
          end)
        end
        random:close()
        while written < count do
          loop.sleep(10)
        end
        loop.sleep(300)
        return rss_kib(host.pid) - before
      end, 20000)
      assert.is_true(grown < 8 * 1024, string.format("the host's RSS grew by %d KiB with %d clients sending %d MiB "
        .. "each without the token", grown, count, sent / 1024 / 1024))
      -- One that asks for the state gets the refusal and nothing else.
      local asking = process.in_coroutine(function()
        local client = connect(port)
        clients[#clients + 1] = client
        client.channel:send(protocol.request(1, "state"))
        while not client.closed do
          loop.sleep(10)
        end
        return client
      end, 10000)
      assert.are.same({ protocol.failure({ id = 1, cmd = "state" }, "UNAUTHENTICATED",
        "refused: this session's endpoint takes connections over TCP with its token only") }, asking.messages)
      for _, client in ipairs(clients) do
        client.channel:close()
      end
      for rank = 0, 1 do
        ranks[rank + 1] = process.start(process.wsync_binary(), { "trainer", "--endpoint", endpoint, "--rank",
          tostring(rank), "--world", "2", "--model", "tiny", "--versions", "3" })
      end
      process.drive(function()
        return host.done and ranks[1].done and ranks[2].done
      end, 60000, "the session to end")
      assert.are.equal(0, host.code, host.stdout .. host.stderr)
      for _, rank in ipairs(ranks) do
        assert.are.equal(0, rank.code, rank.stderr)
      end
      local _, frames = host.stdout:gsub("refused agent at 127%.0%.0%.1:%d+: frame of 16777216 bytes exceeds the "
        .. "4096%-byte limit before proving the token\n", "")
      assert.are.equal(count, frames, host.stdout)
      assert.matches("refused agent at 127%.0%.0%.1:%d+: 'state' before the token\n", host.stdout)
      assert.matches("verdict: OK: 3 model versions published", host.stdout, 1, true)
    end)
    for _, client in ipairs(clients) do
      client.channel:close()
    end
    for _, proc in ipairs({ host, unpack(ranks) }) do
      process.finish(proc)
    end
    assert(ok, err)
  end)
end)
