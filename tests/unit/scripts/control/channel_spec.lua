-- wsync.control.channel: framed messages over a libuv stream, checked with two ends
-- of a socket pair (and of a one-way pipe) in this process.
local uv = require("luv")
local channel = require("wsync.control.channel")
local loop = require("wsync.loop")
local protocol = require("wsync.control.protocol")
local async = require("tests.helpers.async")

-- A libuv pipe handle over file descriptor `fd`.
local function stream(fd)
  local pipe = uv.new_pipe(false)
  assert(pipe:open(fd))
  return pipe
end

-- One end of a connection: a channel recording what it receives. `wait()`
-- (inside a coroutine) returns once `count` messages or a close have arrived.
local function endpoint(fd, options)
  local self = { messages = {}, closes = {} }
  local waiter, wanted = nil, nil
  local function poke()
    if waiter and (#self.messages >= wanted or #self.closes > 0) then
      local resume = waiter
      waiter = nil
      resume()
    end
  end
  self.channel = channel.new(stream(fd), {
    limit = options and options.limit,
    on_message = function(message)
      self.messages[#self.messages + 1] = message
      poke()
    end,
    on_close = function(reason)
      self.closes[#self.closes + 1] = reason
      poke()
    end,
  })
  function self.wait(count)
    wanted = count or 1
    if #self.messages >= wanted or #self.closes > 0 then
      return
    end
    loop.await(function(resume)
      waiter = resume
    end)
  end
  return self
end

-- Two connected endpoints over a socket pair.
local function connected_pair(options)
  local fds = assert(uv.socketpair(nil, nil, { nonblock = true }, { nonblock = true }))
  return endpoint(fds[1], options), endpoint(fds[2], options)
end

-- Lets the loop run for `ms` so that anything still on its way arrives.
local function settle(ms)
  loop.sleep(ms or 20)
end

describe("wsync.control.channel", function()
  local open_ends = {}

  -- Every test closes its ends; this only closes what a failing one left.
  after_each(function()
    for _, side in ipairs(open_ends) do
      side.channel:close()
    end
    open_ends = {}
  end)

  local function pair(options)
    local a, b = connected_pair(options)
    open_ends[#open_ends + 1] = a
    open_ends[#open_ends + 1] = b
    return a, b
  end

  it("carries messages both ways, in order", function()
    async.run_async(function()
      local a, b = pair()
      for id = 1, 50 do
        assert(a.channel:send(protocol.request(id, "info", { n = id })))
      end
      b.wait(50)
      assert(b.channel:send(protocol.success({ id = 1, cmd = "info" }, { answer = "yes" })))
      a.wait(1)
      assert.are.equal(50, #b.messages)
      for id = 1, 50 do
        assert.are.same(protocol.request(id, "info", { n = id }), b.messages[id])
      end
      assert.are.same({ protocol.success({ id = 1, cmd = "info" }, { answer = "yes" }) }, a.messages)
      assert.are.same({}, a.closes)
      assert.are.same({}, b.closes)
      a.channel:close()
      b.channel:close()
    end)
  end)

  it("carries a message of several hundred kilobytes", function()
    async.run_async(function()
      local a, b = pair()
      local blob = string.rep("0123456789abcdef", 40000)
      assert(a.channel:send({ blob = blob }))
      b.wait(1)
      assert.are.equal(blob, b.messages[1].blob)
      a.channel:close()
      b.channel:close()
    end)
  end)

  it("works over a one-way pipe from uv.pipe", function()
    async.run_async(function()
      local fds = assert(uv.pipe({ nonblock = true }, { nonblock = true }))
      local reader = endpoint(fds.read)
      local writer = channel.new(stream(fds.write), {
        on_message = function() end,
        on_close = function() end,
      })
      open_ends[#open_ends + 1] = reader
      open_ends[#open_ends + 1] = { channel = writer }
      writer.stream:read_stop() -- a write-only end: nothing to read
      assert(writer:send({ hello = "pipe" }))
      reader.wait(1)
      assert.are.same({ { hello = "pipe" } }, reader.messages)
      writer:close()
      reader.wait(2) -- the writer's close reaches the reader as EOF
      assert.are.same({ "EOF" }, reader.closes)
      assert.is_true(reader.channel.closed)
    end)
  end)

  it("reports EOF once when the peer closes, and closes itself", function()
    async.run_async(function()
      local a, b = pair()
      assert(a.channel:send({ last = true }))
      a.channel:close()
      b.wait(2)
      settle()
      assert.are.same({ { last = true } }, b.messages)
      assert.are.same({ "EOF" }, b.closes)
      assert.is_true(b.channel.closed)
      assert.is_true(b.channel.stream:is_closing())
      b.channel:close() -- a second close is harmless
      assert.are.same({}, a.closes, "closing an end does not report to its own on_close")
    end)
  end)

  it("refuses to send once closed", function()
    async.run_async(function()
      local a, b = pair()
      a.channel:close()
      local sent, reason = a.channel:send({ late = true })
      assert.is_nil(sent)
      assert.are.equal("channel is closed", reason)
      assert.is_nil((a.channel:send_raw("\0\0\0\2{}")))
      b.wait(1)
      assert.are.same({ "EOF" }, b.closes)
    end)
  end)

  it("refuses to send a message over its limit and stays open", function()
    async.run_async(function()
      local a, b = pair({ limit = 64 })
      local sent, reason = a.channel:send({ pad = string.rep("x", 100) })
      assert.is_nil(sent)
      assert.matches("exceeds the 64-byte limit", reason, 1, true)
      assert.is_false(a.channel.closed)
      assert(a.channel:send({ small = 1 }))
      b.wait(1)
      assert.are.same({ { small = 1 } }, b.messages)
      a.channel:close()
      b.channel:close()
    end)
  end)

  it("sends a last message: the other end reads it and then EOF; this end is closed at once, quietly", function()
    async.run_async(function()
      local a, b = pair()
      a.channel:send_last({ last = true })
      assert.is_true(a.channel.closed)
      assert.is_nil((a.channel:send({ later = true })))
      b.wait(2)
      settle()
      assert.are.same({ { last = true } }, b.messages)
      assert.are.same({ "EOF" }, b.closes)
      assert.are.same({}, a.closes)
      assert.is_true(a.channel.stream:is_closing())
    end)
  end)

  it("refuses a frame at its length prefix once the limit is lowered, holding none of its body", function()
    async.run_async(function()
      local a, b = pair()
      b.channel:set_limit(64)
      -- (The length of a 1 MiB frame, and a first part of its body.)
      assert(a.channel:send_raw("\0\16\0\0" .. string.rep("x", 1000)))
      b.wait(1)
      assert.are.same({ "frame of 1048576 bytes exceeds the 64-byte limit" }, b.closes)
      assert.is_nil(b.channel.decoder, "the closed channel still holds what it read")
      a.wait(1)
    end)
  end)

  local bad_frames = {
    { "an undecodable frame", "\0\0\0\12{{not json}}", "undecodable frame" },
    { "a non-object frame", "\0\0\0\0042024", "a JSON number, not an object" },
    { "an oversize length prefix", "\1\0\0\1{", "frame of 16777217 bytes exceeds the 16777216-byte limit" },
  }
  for _, case in ipairs(bad_frames) do
    it("closes with the reason on " .. case[1] .. ", delivering nothing after it", function()
      async.run_async(function()
        local a, b = pair()
        assert(a.channel:send({ before = true }))
        assert(a.channel:send_raw(case[2] .. protocol.encode({ after = true })))
        b.wait(2)
        settle()
        assert.are.same({ { before = true } }, b.messages)
        assert.are.equal(1, #b.closes)
        assert.matches(case[3], b.closes[1], 1, true)
        assert.is_true(b.channel.closed)
        a.wait(1) -- and the sender sees the connection end
        assert.are.same({ "EOF" }, a.closes)
      end)
    end)
  end

  it("stops delivering when on_message closes the channel", function()
    async.run_async(function()
      local fds = assert(uv.socketpair(nil, nil, { nonblock = true }, { nonblock = true }))
      local sender = endpoint(fds[1])
      open_ends[#open_ends + 1] = sender
      local received, receiver = {}, nil
      receiver = channel.new(stream(fds[2]), {
        on_message = function(message)
          received[#received + 1] = message
          receiver:close()
        end,
        on_close = function(reason)
          received[#received + 1] = "closed: " .. reason
        end,
      })
      open_ends[#open_ends + 1] = { channel = receiver }
      assert(sender.channel:send_raw(protocol.encode({ n = 1 }) .. protocol.encode({ n = 2 })))
      sender.wait(1)
      assert.are.same({ { n = 1 } }, received)
      assert.are.same({ "EOF" }, sender.closes)
    end)
  end)
end)

describe("wsync.control.inflight", function()
  local inflight_module = require("wsync.control.inflight")
  local open_ends, trackers = {}, {}

  -- Every test closes what it opened; this closes what a failing one left,
  -- so that one failure cannot keep the loop (and the next test) waiting.
  after_each(function()
    for _, inflight in ipairs(trackers) do
      inflight:close()
    end
    for _, side in ipairs(open_ends) do
      side.channel:close()
    end
    open_ends, trackers = {}, {}
  end)

  local function connected()
    local a, b = connected_pair()
    open_ends[#open_ends + 1] = a
    open_ends[#open_ends + 1] = b
    return a, b
  end

  local function tracker(channel_value)
    local inflight = inflight_module.new(channel_value)
    trackers[#trackers + 1] = inflight
    return inflight
  end

  it("numbers requests, matches the answer and wakes the waiting caller", function()
    async.run_async(function()
      local a, b = connected()
      local inflight = tracker(a.channel)
      for id = 1, 2 do
        local pending = assert(inflight:send("info", { n = id }, 5, function()
          error("timed out")
        end))
        assert.are.equal(id, pending.id)
        b.wait(id)
        assert.are.same(protocol.request(id, "info", { n = id }), b.messages[id])
        -- The owner hands the answer over as peer and runtime client do.
        a.channel.on_message = function(message)
          local taken = assert(inflight:take(message))
          taken.resume(true, message.result)
        end
        assert(b.channel:send(protocol.success(b.messages[id], { echo = id })))
        local ok, result = inflight:await(pending)
        assert.is_true(ok)
        assert.are.same({ echo = id }, result)
        assert.is_nil(inflight.pending)
      end
      inflight:close()
      a.channel:close()
      b.channel:close()
    end)
  end)

  it("refuses an answer that does not fit the request, and one with none in flight", function()
    async.run_async(function()
      local a, b = connected()
      local inflight = tracker(a.channel)
      local taken, reason = inflight:take(protocol.success({ id = 1, cmd = "info" }, {}))
      assert.is_nil(taken)
      assert.are.equal("unsolicited response info", reason)
      local pending = assert(inflight:send("info", {}, 5, function() end))
      taken, reason = inflight:take(protocol.success({ id = 7, cmd = "info" }, {}))
      assert.is_nil(taken)
      assert.matches("id", reason)
      taken, reason = inflight:take(protocol.success({ id = 1, cmd = "sleep" }, {}))
      assert.is_nil(taken)
      assert.matches("sleep", reason)
      assert.are.equal(pending, inflight.pending, "a bad answer leaves the request in flight")
      inflight:close()
      a.channel:close()
      b.channel:close()
    end)
  end)

  it("calls on_timeout with the request when no answer comes", function()
    async.run_async(function()
      local a, b = connected()
      local inflight = tracker(a.channel)
      local pending = assert(inflight:send("hang", {}, 0.05, function(timed_out)
        timed_out.resume(false, "timeout of " .. timed_out.cmd)
      end))
      local ok, err = inflight:await(pending)
      assert.is_false(ok)
      assert.are.equal("timeout of hang", err)
      inflight:close()
      a.channel:close()
      b.channel:close()
    end)
  end)

  it("says why a request cannot be sent", function()
    async.run_async(function()
      local a, b = connected()
      a.channel:close()
      local inflight = tracker(a.channel)
      local pending, reason = inflight:send("info", {}, 5, function() end)
      assert.is_nil(pending)
      assert.are.equal("channel is closed", reason)
      assert.is_nil(inflight.pending)
      inflight:close()
      b.channel:close()
    end)
  end)
end)
