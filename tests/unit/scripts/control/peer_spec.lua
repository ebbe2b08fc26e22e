-- wsync.control.peer, the two-way connection between the host and a trainer
-- agent, over a socket pair in this process: a peer on one end and, on the
-- other, either a second peer or a bare channel that writes whatever a test
-- wants (wrong ids, wrong protocol, second requests, malformed frames).
local uv = require("luv")
local async = require("tests.helpers.async")
local channel_module = require("wsync.control.channel")
local loop = require("wsync.loop")
local peer_module = require("wsync.control.peer")
local protocol = require("wsync.control.protocol")
local schema = require("wsync.recipe.schema")

local run_async = async.run_async

local function stream(fd)
  local pipe = uv.new_pipe(false)
  assert(pipe:open(fd))
  return pipe
end

-- Runs the loop until `predicate()` holds (inside a coroutine), failing after
-- `ms` milliseconds.
local function wait_for(predicate, ms, what)
  local deadline = uv.hrtime() + (ms or 2000) * 1e6
  while not predicate() do
    assert(uv.hrtime() < deadline, "timed out waiting for " .. what)
    loop.sleep(2)
  end
end

-- Schemas for the tests: `put` requests need an integer `value`; `get`
-- results need a string `text`.
local SCHEMAS = {
  requests = { put = schema.record({ fields = { value = schema.number({ integer = true, required = true }) } }) },
  results = { get = schema.record({ fields = { text = schema.string({ required = true }) } }) },
}

describe("wsync.control.peer", function()
  local opened = {}

  -- Every test closes its ends; this closes what a failing one left.
  after_each(function()
    for _, close in ipairs(opened) do
      close()
    end
    opened = {}
  end)

  -- A peer on `fd` named for the end it faces (as the host names a
  -- connection for its agent), recording its on_close and on_bad_request calls.
  local function new_peer(fd, name, options)
    options = options or {}
    local closes, bad_requests = {}, {}
    local peer = peer_module.new(stream(fd), {
      name = name,
      handlers = options.handlers,
      schemas = options.schemas,
      on_close = function(reason, violation)
        closes[#closes + 1] = { reason = reason, violation = violation }
      end,
      on_bad_request = function(cmd, reason)
        bad_requests[#bad_requests + 1] = { cmd = cmd, reason = reason }
      end,
    })
    opened[#opened + 1] = function()
      peer:close("test over")
    end
    return peer, closes, bad_requests
  end

  -- Two peers over a socket pair: the agent's end `a` (facing "the host")
  -- and the host's end `b` (facing "agent 0").
  local function peers(a_options, b_options)
    local fds = assert(uv.socketpair(nil, nil, { nonblock = true }, { nonblock = true }))
    local a, a_closes, a_bad = new_peer(fds[1], "the host", a_options)
    local b, b_closes = new_peer(fds[2], "agent 0", b_options)
    return a, b, { a = a_closes, b = b_closes, a_bad = a_bad }
  end

  -- The host's end of a connection to "agent 0", facing a bare channel that records what it receives in
  -- `raw.messages` and whose `raw.channel` sends anything.
  local function peer_and_raw(options)
    local fds = assert(uv.socketpair(nil, nil, { nonblock = true }, { nonblock = true }))
    local peer, closes, bad_requests = new_peer(fds[1], "agent 0", options)
    local raw = { messages = {}, closed = nil }
    raw.channel = channel_module.new(stream(fds[2]), {
      on_message = function(message)
        raw.messages[#raw.messages + 1] = message
      end,
      on_close = function(reason)
        raw.closed = reason
      end,
    })
    opened[#opened + 1] = function()
      raw.channel:close()
    end
    return peer, raw, closes, bad_requests
  end

  describe("request", function()
    it("sends a request and returns the other end's result, both ways", function()
      run_async(function()
        local a, b = peers({
          handlers = { where = function(payload) return { here = "agent", asked = payload.n } end },
        }, {
          handlers = { echo = function(payload, request) return { payload = payload, cmd = request.cmd } end },
        })
        local payload = { n = 1, list = { "x" } }
        assert.are.same({ payload = payload, cmd = "echo" }, a:request("echo", payload))
        assert.are.same({ here = "agent", asked = 2 }, b:request("where", { n = 2 }))
        assert.are.same({ payload = {}, cmd = "echo" }, a:request("echo"))
        a:close()
      end)
    end)

    it("answers a request while its own waits for the other's answer", function()
      run_async(function()
        local a, b
        a, b = peers({
          handlers = { ping = function() return { pong = true } end },
        }, {
          -- The host asks the agent something before it answers the agent.
          handlers = { publish = function() return { inner = b:request("ping") } end },
        })
        assert.are.same({ inner = { pong = true } }, a:request("publish"))
        a:close()
      end)
    end)

    it("raises the other end's error object with its code and fields", function()
      run_async(function()
        local errors = require("wsync.errors")
        local a = peers(nil, {
          handlers = {
            coded = function() errors.raise("NOT_NOW", "try later", { rank = 3, phase = "publish" }) end,
            plain = function() error("a bug in the handler") end,
          },
        })
        local ok, err = pcall(a.request, a, "coded")
        assert.is_false(ok)
        assert.are.equal("NOT_NOW", err.code)
        assert.are.equal("try later", err.message)
        assert.are.equal(3, err.rank)
        assert.are.equal("publish", err.phase)
        assert.is_true(err.remote)
        ok, err = pcall(a.request, a, "plain")
        assert.is_false(ok)
        assert.are.equal("LUA_ERROR", err.code)
        assert.matches("a bug in the handler", err.message, 1, true)
        assert.is_false(a.closed, "a failed command leaves the connection open")
        a:close()
      end)
    end)

    it("answers a command it has no handler for with UNKNOWN_COMMAND and stays open", function()
      run_async(function()
        local a, b = peers()
        local ok, err = pcall(a.request, a, "nothing")
        assert.is_false(ok)
        assert.are.equal("UNKNOWN_COMMAND", err.code)
        assert.matches("no handler for 'nothing' on this side of agent 0", err.message, 1, true)
        assert.is_false(a.closed)
        assert.is_false(b.closed)
        a:close()
      end)
    end)

    it("refuses a second request of its own while one is in flight; the first still gets its answer", function()
      run_async(function()
        local a = peers(nil, {
          handlers = { slow = function() loop.sleep(50) return { done = true } end },
        })
        local first = async.start(function()
          return a:request("slow")
        end)
        local ok, err = pcall(a.request, a, "echo")
        assert.is_false(ok)
        assert.matches("the host: echo requested while slow is in flight", err, 1, true)
        local first_ok, result = first()
        assert.is_true(first_ok, tostring(result))
        assert.are.same({ done = true }, result)
        a:close()
      end)
    end)
  end)

  describe("schemas", function()
    it("answers a request whose payload does not fit with BAD_MESSAGE naming the field, and stays open", function()
      run_async(function()
        local handled = 0
        local a, b, seen = peers({
          schemas = SCHEMAS,
          handlers = { put = function() handled = handled + 1 return {} end },
        })
        local ok, err = pcall(b.request, b, "put", { value = "seven" })
        assert.is_false(ok)
        assert.are.equal("BAD_MESSAGE", err.code)
        assert.matches("put: field 'value'", err.message, 1, true)
        assert.are.equal(0, handled, "the handler ran on a malformed payload")
        assert.are.equal(1, #seen.a_bad)
        assert.are.equal("put", seen.a_bad[1].cmd)
        assert.matches("field 'value'", seen.a_bad[1].reason, 1, true)
        assert.is_false(a.closed)
        assert.are.same({}, b:request("put", { value = 7 }))
        assert.are.equal(1, handled)
        a:close()
      end)
    end)

    it("fails a request whose result does not fit with BAD_MESSAGE, and stays open", function()
      run_async(function()
        local answer = { text = 7 }
        local a = peers({ schemas = SCHEMAS }, {
          handlers = { get = function() return answer end },
        })
        local ok, err = pcall(a.request, a, "get")
        assert.is_false(ok)
        assert.are.equal("BAD_MESSAGE", err.code)
        assert.are.equal("get", err.phase)
        assert.matches("the host answered get: field 'text': ", err.message, 1, true)
        assert.is_false(a.closed)
        answer = { text = "fits" }
        assert.are.same({ text = "fits" }, a:request("get"))
        a:close()
      end)
    end)
  end)

  describe("ends the connection", function()
    it("when no answer comes in time: PEER_LOST naming the timeout, at once for later requests", function()
      run_async(function()
        local a, raw, closes = peer_and_raw()
        local started = uv.hrtime()
        local ok, err = pcall(a.request, a, "slow", {}, 0.1)
        assert.is_false(ok)
        -- (libuv times from the loop's cached clock: allow for its lag)
        assert.is_true(uv.hrtime() - started >= 0.05e9, "it gave up long before the timeout")
        assert.are.equal("PEER_LOST", err.code)
        assert.are.equal("slow", err.phase)
        assert.matches("agent 0: timeout: no answer to slow within 0.1 s (during slow)", err.message, 1, true)
        assert.is_true(a.closed)
        wait_for(function() return #closes > 0 end, 5000, "on_close")
        assert.are.same({ { reason = "timeout: no answer to slow within 0.1 s", violation = false } }, closes)
        -- A later request fails at once: in a bare coroutine, which wsync.loop
        -- cannot resume, it ends all the same.
        local co = coroutine.create(pcall)
        local resumed, again_ok, again = coroutine.resume(co, a.request, a, "echo")
        assert.is_true(resumed)
        assert.are.equal("dead", coroutine.status(co))
        assert.is_false(again_ok)
        assert.are.equal("PEER_LOST", again.code)
        assert.matches("agent 0: connection closed: timeout: no answer to slow within 0.1 s", again.message, 1, true)
        wait_for(function() return raw.closed ~= nil end, 5000, "the far end's EOF")
        assert.are.equal("EOF", raw.closed)
      end)
    end)

    it("on EOF: the request in flight fails with PEER_LOST, on_close runs once, not as a violation", function()
      run_async(function()
        local a, raw, closes = peer_and_raw()
        local waiting = async.start(function()
          return a:request("slow")
        end)
        wait_for(function() return #raw.messages == 1 end, 5000, "the request")
        raw.channel:close()
        local ok, err = waiting()
        assert.is_false(ok)
        assert.are.equal("PEER_LOST", err.code)
        assert.matches("agent 0: agent 0 closed the connection (during slow)", err.message, 1, true)
        wait_for(function() return #closes > 0 end, 5000, "on_close")
        assert.are.same({ { reason = "agent 0 closed the connection", violation = false } }, closes)
        a:close("again")
        assert.are.equal(1, #closes, "on_close ran twice")
      end)
    end)

    for _, case in ipairs({
      { "an answer with another id", function(m) m.id = m.id + 1 end, "response id 2 does not match request id 1" },
      { "an answer to another command", function(m) m.cmd = "other" end,
        "response cmd other does not match request cmd slow" },
      { "an answer in another protocol version", function(m) m.protocol = protocol.VERSION + 1 end,
        string.format("peer speaks protocol %d, this side speaks %d", protocol.VERSION + 1, protocol.VERSION) },
      { "an answer without a boolean ok", function(m) m.ok = "yes" end, "response to slow has no boolean ok" },
      { "a failure without an error {code, message}", function(m) m.ok, m.result, m.error = false, nil, "no" end,
        "failed slow response without an error {code, message}" },
    }) do
      it("on " .. case[1] .. ": a protocol violation", function()
        run_async(function()
          local a, raw, closes = peer_and_raw()
          local waiting = async.start(function()
            return a:request("slow")
          end)
          wait_for(function() return #raw.messages == 1 end, 5000, "the request")
          local answer = protocol.success(raw.messages[1], {})
          case[2](answer)
          raw.channel:send(answer)
          local ok, err = waiting()
          assert.is_false(ok)
          assert.are.equal("PEER_LOST", err.code)
          assert.matches("agent 0: " .. case[3] .. " (during slow)", err.message, 1, true)
          wait_for(function() return #closes > 0 end, 5000, "on_close")
          assert.are.same({ { reason = case[3], violation = true } }, closes)
        end)
      end)
    end

    it("on an answer nobody asked for", function()
      run_async(function()
        local a, raw, closes = peer_and_raw()
        raw.channel:send(protocol.success({ id = 1, cmd = "ghost" }, {}))
        wait_for(function() return a.closed end, 5000, "the connection to end")
        assert.are.same({ { reason = "unsolicited response ghost", violation = true } }, closes)
      end)
    end)

    it("on an undecodable frame", function()
      run_async(function()
        local a, raw, closes = peer_and_raw()
        raw.channel:send_raw("\0\0\0\5[1,2]")
        wait_for(function() return a.closed end, 5000, "the connection to end")
        assert.are.equal(1, #closes)
        assert.matches("^undecodable frame: a JSON array, not an object", closes[1].reason)
        assert.is_true(closes[1].violation)
      end)
    end)

    for _, case in ipairs({
      { "a request in another protocol version", { protocol = protocol.VERSION + 1, id = 4, cmd = "x" },
        "PROTOCOL_MISMATCH", "peer speaks protocol" },
      { "a request without a numeric id", { protocol = protocol.VERSION, id = "4", cmd = "x" },
        "BAD_REQUEST", "request without a numeric id and a string cmd" },
      { "a request whose payload is not an object", { protocol = protocol.VERSION, id = 4, cmd = "x", payload = 3 },
        "BAD_REQUEST", "request payload is not an object" },
    }) do
      it("on " .. case[1] .. ", answered with " .. case[3] .. " first", function()
        run_async(function()
          local a, raw, closes = peer_and_raw()
          raw.channel:send(case[2])
          wait_for(function() return a.closed and #raw.messages == 1 end, 5000, "the refusal")
          local refusal = raw.messages[1]
          assert.is_false(refusal.ok)
          assert.are.equal(4, refusal.id)
          assert.are.equal(case[3], refusal.error.code)
          assert.matches(case[4], refusal.error.message, 1, true)
          assert.are.equal(1, #closes)
          assert.is_true(closes[1].violation)
        end)
      end)
    end

    it("on a second request from the other end while one is being answered", function()
      run_async(function()
        local a, raw, closes = peer_and_raw({
          handlers = { slow = function() loop.sleep(50) return {} end },
        })
        raw.channel:send(protocol.request(1, "slow"))
        raw.channel:send(protocol.request(2, "slow"))
        wait_for(function() return a.closed end, 5000, "the connection to end")
        assert.are.same({ { reason = "agent 0 sent a second request while one was being answered", violation = true } },
          closes)
        loop.sleep(80) -- the first handler ends after the close: its answer is dropped
        assert.are.same({}, raw.messages)
      end)
    end)

    it("on close(reason): the request in flight fails with it, the other end sees EOF", function()
      run_async(function()
        local a, raw, closes = peer_and_raw()
        local waiting = async.start(function()
          return a:request("slow")
        end)
        a:close("the host is leaving")
        local ok, err = waiting()
        assert.is_false(ok)
        assert.are.equal("PEER_LOST", err.code)
        assert.matches("agent 0: the host is leaving (during slow)", err.message, 1, true)
        wait_for(function() return #closes > 0 end, 5000, "on_close")
        assert.are.same({ { reason = "the host is leaving", violation = false } }, closes)
        assert.are.equal("the host is leaving", a.cause)
        local again_ok, again = pcall(a.request, a, "echo")
        assert.is_false(again_ok)
        assert.matches("connection closed: the host is leaving", again.message, 1, true)
        wait_for(function() return raw.closed ~= nil end, 5000, "the far end's EOF")
        assert.are.equal("EOF", raw.closed)
      end)
    end)
  end)
end)
