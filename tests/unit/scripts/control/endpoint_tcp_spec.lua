-- The TCP side of the control endpoint: addresses, the token that stands in
-- for the unix socket's user check, and what a connection gets before it has
-- proved the token (one refusal, small frames, a deadline, a cap on how many
-- wait), over loopback in this process.
local uv = require("luv")
local async = require("tests.helpers.async")
local agent_module = require("wsync.trainer.agent")
local channel_module = require("wsync.control.channel")
local endpoint_module = require("wsync.control.endpoint")
local loop = require("wsync.loop")
local protocol = require("wsync.control.protocol")

local run_async = async.run_async

describe("wsync.control.endpoint over TCP", function()
  it("reads ADDRESS:PORT and [IPv6]:PORT, and names what is not one", function()
    assert.are.same({ "10.0.0.1", 4000 }, { endpoint_module.parse_address("10.0.0.1:4000") })
    assert.are.same({ "::1", 0 }, { endpoint_module.parse_address("[::1]:0") })
    for _, bad in ipairs({ "10.0.0.1", "host:port", "10.0.0.1:70000", ":80" }) do
      local address, why = endpoint_module.parse_address(bad)
      assert.is_nil(address)
      assert.are.equal(bad .. " is not ADDRESS:PORT", why)
    end
  end)

  it("takes the session's token only", function()
    local token = "0123456789abcdef0123456789abcdef"
    assert.is_true(endpoint_module.token_matches(token, token))
    assert.is_false(endpoint_module.token_matches(token, "0123456789abcdef0123456789abcdee"))
    assert.is_false(endpoint_module.token_matches(token, token:sub(1, 31)))
    assert.is_false(endpoint_module.token_matches(token, nil))
    assert.is_false(endpoint_module.token_matches(token, 7))
  end)
end)

describe("wsync.control.endpoint, a TCP connection before the token", function()
  local opened = {}

  -- Closes what the test opened, the last first.
  local function close_opened()
    for index = #opened, 1, -1 do
      opened[index]()
    end
    opened = {}
  end

  -- What a test that failed before it closed its end left (run_async stops
  -- the loop then) is closed here.
  after_each(close_opened)

  -- Runs the loop (inside a coroutine) until `predicate()` holds, failing
  -- after `ms` milliseconds.
  local function wait_for(predicate, ms, what)
    local deadline = uv.hrtime() + ms * 1e6
    while not predicate() do
      assert(uv.hrtime() < deadline, "timed out waiting for " .. what)
      loop.sleep(2)
    end
  end

  -- An endpoint on loopback whose handlers answer `state` with what a
  -- stranger must not read (counting the calls in `host.served`) and fail
  -- `crash` with a Lua error; `host.lines` collects its on_refused lines.
  -- `overrides` go into its options.
  local function listen(overrides)
    local parent = assert(uv.fs_mkdtemp((os.getenv("TMPDIR") or "/tmp") .. "/wsync-test-XXXXXX"))
    local host = { lines = {}, served = 0 }
    local options = {
      parent = parent,
      tcp = "127.0.0.1:0",
      handlers_for = function()
        return {
          state = function()
            host.served = host.served + 1
            return { ranks = { { pid = 4242, device = "GPU-secret" } } }
          end,
          crash = function()
            error("a bug in the handler")
          end,
        }
      end,
      on_refused = function(line)
        host.lines[#host.lines + 1] = line
      end,
    }
    for key, value in pairs(overrides or {}) do
      options[key] = value
    end
    host.endpoint = endpoint_module.listen(options)
    host.port = tonumber(host.endpoint.tcp_endpoint:match(":(%d+)%?token="))
    opened[#opened + 1] = function()
      host.endpoint:close()
      uv.fs_rmdir(parent)
    end
    return host
  end

  -- Runs `fn(host)` in a coroutine on an endpoint from listen(overrides),
  -- then closes the endpoint and every client (the loop ends once nothing
  -- is left open).
  local function run(overrides, fn)
    run_async(function()
      local ok, err = pcall(fn, listen(overrides))
      close_opened()
      if not ok then
        error(err, 0)
      end
    end)
  end

  -- A bare client on the endpoint's TCP port: a channel recording what the
  -- host sends (`messages`) and why the connection ended (`closed`).
  local function connect(host)
    local tcp = uv.new_tcp()
    local ok, err = loop.await(function(resume)
      tcp:connect("127.0.0.1", host.port, function(connect_error)
        resume(connect_error == nil, connect_error)
      end)
    end)
    assert(ok, err)
    -- (`port`: the client's own, by which the host names it.)
    local client = { messages = {}, closed = nil, port = tcp:getsockname().port }
    client.channel = channel_module.new(tcp, {
      on_message = function(message)
        client.messages[#client.messages + 1] = message
      end,
      on_close = function(reason)
        client.closed = reason
      end,
    })
    opened[#opened + 1] = function()
      client.channel:close()
    end
    return client
  end

  -- The one answer anything but the token gets: UNAUTHENTICATED with the
  -- generic refusal, no result, no traceback, no other field.
  local function assert_refused(client, cmd)
    wait_for(function()
      return client.closed ~= nil
    end, 2000, "the host to close the connection")
    assert.are.equal("EOF", client.closed)
    assert.are.equal(1, #client.messages)
    local answer = client.messages[1]
    assert.is_false(answer.ok)
    assert.is_nil(answer.result)
    assert.are.equal(cmd, answer.cmd)
    assert.are.same({ code = "UNAUTHENTICATED", message = endpoint_module.REFUSAL }, answer.error)
  end

  it("answers a client that asks for the state without the token with one refusal, and closes it", function()
    run(nil, function(host)
      local client = connect(host)
      client.channel:send(protocol.request(1, "state"))
      assert_refused(client, "state")
      assert.are.equal(0, host.served, "the state handler ran for a client without the token")
      assert.are.equal(1, #host.lines)
      assert.matches("^refused agent at 127%.0%.0%.1:%d+: 'state' before the token$", host.lines[1])
    end)
  end)

  local instead = {
    { "a wrong token", protocol.request(1, "hello", { token = string.rep("0", 32) }), "hello", "a wrong token" },
    { "a hello without a token", protocol.request(1, "hello"), "hello", "no token" },
    { "a register carrying the token", function(host)
      return protocol.request(1, "register", { token = host.endpoint.token })
    end, "register", "'register' before the token" },
    { "a handler's failure", protocol.request(1, "crash"), "crash", "'crash' before the token" },
    { "an answer", { protocol = protocol.VERSION, id = 1, cmd = "state", ok = true, result = {} }, "state",
      "an answer before the token" },
    { "a request of another protocol", { protocol = 0, id = 1, cmd = "hello" }, "hello", "no token" },
    { "a cmd that is an object", { protocol = protocol.VERSION, id = 1, cmd = { "hello" } }, "table",
      "a request before the token" },
  }
  for _, case in ipairs(instead) do
    it("answers " .. case[1] .. " with the same refusal, and closes the connection", function()
      run(nil, function(host)
        local client = connect(host)
        local message = type(case[2]) == "function" and case[2](host) or case[2]
        client.channel:send(message)
        assert_refused(client, case[3])
        assert.are.same({ string.format("refused agent at 127.0.0.1:%d: %s", client.port, case[4]) }, host.lines)
      end)
    end)
  end

  it("serves a client once it has proved the token, frames of the normal size included", function()
    run(nil, function(host)
      local client = connect(host)
      client.channel:send(protocol.request(1, "hello", { token = host.endpoint.token }))
      wait_for(function()
        return #client.messages == 1
      end, 2000, "the answer to hello")
      assert.are.same(protocol.success({ id = 1, cmd = "hello" }, {}), client.messages[1])
      -- Larger than the limit before the token: the limit is the normal one now.
      client.channel:send(protocol.request(2, "state", { padding = string.rep("x", 64 * 1024) }))
      wait_for(function()
        return #client.messages == 2
      end, 2000, "the answer to state")
      assert.is_true(client.messages[2].ok)
      assert.are.equal(4242, client.messages[2].result.ranks[1].pid)
      assert.are.equal(1, host.served)
      assert.is_nil(client.closed)
      assert.are.same({}, host.lines)
    end)
  end)

  it("refuses a frame announced over the small limit at its length, without waiting for its body", function()
    run(nil, function(host)
      local client = connect(host)
      -- A 16 MiB frame's length prefix and the first 4 KiB of its body.
      client.channel:send_raw("\1\0\0\0" .. string.rep("x", 4096))
      wait_for(function()
        return client.closed ~= nil
      end, 2000, "the host to close the connection")
      assert.are.same({}, client.messages)
      assert.are.equal(1, #host.lines)
      assert.matches("^refused agent at 127%.0%.0%.1:%d+: frame of 16777216 bytes exceeds the "
        .. endpoint_module.UNAUTHENTICATED_FRAME_LIMIT .. "%-byte limit before proving the token$", host.lines[1])
    end)
  end)

  it("closes a client that does not prove the token within the deadline", function()
    run({ authentication_deadline = 0.2 }, function(host)
      local started = uv.hrtime()
      local client = connect(host)
      -- (Part of a frame, and then nothing.)
      client.channel:send_raw("\0\0\0\100{")
      wait_for(function()
        return client.closed ~= nil
      end, 3000, "the host to close the idle connection")
      assert.is_true((uv.hrtime() - started) / 1e9 >= 0.19, "closed before the deadline")
      assert.are.equal("EOF", client.closed)
      assert.are.same({}, client.messages)
      assert.matches("^refused agent at 127%.0%.0%.1:%d+: no token within 0%.2 s$", host.lines[1])
      assert.are.equal(1, #host.lines)
    end)
  end)

  it("closes the connections over its cap as they come; once they are gone it serves an agent", function()
    local most = 4
    run({ max_unauthenticated = most }, function(host)
      local clients = {}
      for index = 1, most do
        clients[index] = connect(host)
      end
      local extra = connect(host)
      wait_for(function()
        return extra.closed ~= nil
      end, 2000, "the host to close the connection over its cap")
      assert.are.same({}, extra.messages)
      assert.are.equal(1, #host.lines)
      assert.matches("^refused agent at 127%.0%.0%.1:%d+: 4 connections over TCP are waiting to prove the token "
        .. "already$", host.lines[1])
      loop.sleep(50)
      for index = 1, most do
        assert.is_nil(clients[index].closed, "a connection within the cap was closed")
        clients[index].channel:close()
      end
      wait_for(function()
        return #host.lines == 1 + most
      end, 2000, "the host to see the waiting connections go")
      for index = 2, 1 + most do
        assert.matches(": it closed the connection before proving the token$", host.lines[index])
      end
      -- A real agent, over TCP, with the token: it says hello itself.
      local agent = agent_module.connect({ endpoint = host.endpoint.tcp_endpoint, rank = 0, world = 1 })
      assert.are.equal(4242, agent.peer:request("state", {}, 5).ranks[1].pid)
      agent:close()
      assert.are.equal(1 + most, #host.lines)
    end)
  end)

  it("does not hold the partial large frames of clients without the token", function()
    run(nil, function(host)
      local clients, count = {}, 8
      -- Each announces an 8 MiB frame and sends its first MiB, random bytes
      -- (LuaJIT keeps equal strings once: the host's reads of a repeated
      -- byte would all be one string).
      local random = assert(io.open("/dev/urandom", "rb"))
      local partials = {}
      for index = 1, count do
        partials[index] = "\0\128\0\0" .. random:read(1024 * 1024)
      end
      random:close()
      local function lua_kib()
        collectgarbage("collect")
        collectgarbage("collect")
        return collectgarbage("count")
      end
      local before = lua_kib()
      local written = 0
      for index = 1, count do
        clients[index] = connect(host)
        clients[index].channel.stream:write(partials[index], function()
          written = written + 1
        end)
      end
      wait_for(function()
        return written == count
      end, 5000, "the clients' writes")
      loop.sleep(100) -- (what the host reads, it has read)
      local with = lua_kib()
      assert.is_true(with - before < 1024, string.format("the host holds %.0f KiB more with %d clients without the "
        .. "token, each part of the way through a large frame", with - before, count))
      for index = 1, count do
        clients[index].channel:close()
      end
      wait_for(function()
        return #host.lines == count
      end, 2000, "the host to see the clients go")
      assert.is_true(lua_kib() - before < 512, "the host kept memory after the clients went")
    end)
  end)
end)
