-- wsync.control.protocol: frames, the streaming decoder and its limit, the shape
-- checks of requests and responses.
local protocol = require("wsync.control.protocol")

-- Marks a field that a case removes from a message.
local ABSENT = {}

-- The 4-byte big-endian length prefix of `length`.
local function prefix(length)
  return string.char(math.floor(length / 16777216) % 256, math.floor(length / 65536) % 256,
    math.floor(length / 256) % 256, length % 256)
end

-- A valid response to request `id` of `cmd`.
local function response(id, cmd, fields)
  local message = protocol.success({ id = id, cmd = cmd }, {})
  for key, value in pairs(fields or {}) do
    message[key] = value
  end
  return message
end

describe("wsync.control.protocol frames", function()
  it("round-trips a request and a response through encode and the decoder", function()
    local request = protocol.request(7, "sleep", { level = 2, tags = { "weights", "kv_cache" } })
    local answer = protocol.failure(request, "STATE_REFUSED", "no", { fatal = true, traceback = "tb" })
    local frame = protocol.encode(request) .. protocol.encode(answer)
    local messages = assert(protocol.decoder():push(frame))
    assert.are.same({ request, answer }, messages)
    assert.are.equal(1, messages[1].protocol)
    assert.are.equal(true, messages[2].error.fatal)
  end)

  it("writes a 4-byte big-endian length before the JSON body", function()
    local frame = protocol.encode({ cmd = "info" })
    assert.are.equal(prefix(#frame - 4), frame:sub(1, 4))
    assert.are.equal('{"cmd":"info"}', frame:sub(5))
  end)

  it("decodes a frame split at every byte boundary", function()
    local message = protocol.request(3, "wake", { tags = { "weights" } })
    local frame = protocol.encode(message)
    for split = 0, #frame do
      local decoder = protocol.decoder()
      local first = assert(decoder:push(frame:sub(1, split)))
      local second = assert(decoder:push(frame:sub(split + 1)))
      if split < #frame then
        assert.are.same({}, first, "split at " .. split)
        assert.are.same({ message }, second, "split at " .. split)
      else
        assert.are.same({ message }, first)
        assert.are.same({}, second)
      end
    end
  end)

  it("decodes a frame pushed one byte at a time, each byte once", function()
    local message = protocol.request(4, "checksum")
    local frame = protocol.encode(message)
    local decoder = protocol.decoder()
    local got = {}
    for i = 1, #frame do
      for _, decoded in ipairs(assert(decoder:push(frame:sub(i, i)))) do
        got[#got + 1] = decoded
      end
    end
    assert.are.same({ message }, got)
    assert.are.same({}, assert(decoder:push("")))
  end)

  it("decodes many frames from one push, keeping a trailing partial frame", function()
    local frames, expected = {}, {}
    for id = 1, 100 do
      expected[id] = protocol.request(id, "info", { n = id })
      frames[id] = protocol.encode(expected[id])
    end
    local tail = protocol.encode(protocol.request(101, "info"))
    local decoder = protocol.decoder()
    assert.are.same(expected, assert(decoder:push(table.concat(frames) .. tail:sub(1, 6))))
    assert.are.same({ protocol.request(101, "info") }, assert(decoder:push(tail:sub(7))))
  end)

  it("refuses a length prefix over the limit, naming both sizes, and keeps refusing", function()
    local decoder = protocol.decoder(100)
    local messages, reason = decoder:push(prefix(101) .. "{")
    assert.is_nil(messages)
    assert.are.equal("frame of 101 bytes exceeds the 100-byte limit", reason)
    local again, same = decoder:push(protocol.encode({ ok = true }))
    assert.is_nil(again)
    assert.are.equal(reason, same)
  end)

  it("accepts a frame of exactly the limit", function()
    local body = '{"pad":"' .. string.rep("x", 100 - 10) .. '"}'
    assert.are.equal(100, #body)
    local messages = assert(protocol.decoder(100):push(prefix(100) .. body))
    assert.are.equal(90, #messages[1].pad)
  end)

  it("refuses an oversize prefix even before the body arrives", function()
    local decoder = protocol.decoder()
    local messages, reason = decoder:push(prefix(protocol.MAX_FRAME + 1))
    assert.is_nil(messages)
    assert.matches(tostring(protocol.MAX_FRAME + 1) .. " bytes", reason, 1, true)
    assert.matches(tostring(protocol.MAX_FRAME) .. "-byte limit", reason, 1, true)
  end)

  it("refuses an undecodable body and keeps refusing", function()
    local decoder = protocol.decoder()
    local messages, reason = decoder:push(prefix(12) .. "{{not json}}")
    assert.is_nil(messages)
    assert.matches("^undecodable frame: ", reason)
    assert.is_nil((decoder:push(protocol.encode({ ok = true }))))
  end)

  it("refuses a JSON body that is not an object", function()
    for _, body in ipairs({ "42", '"text"', "true", "null", "[1, 2]", "[]", " [{}]" }) do
      local messages, reason = protocol.decoder():push(prefix(#body) .. body)
      assert.is_nil(messages, body)
      assert.matches("not an object", reason, 1, true)
    end
  end)

  it("hands back the frames that came before a bad one in the same push", function()
    local decoder = protocol.decoder()
    local frames = protocol.encode({ n = 1 }) .. protocol.encode({ n = 2 })
    local messages, reason, before = decoder:push(frames .. prefix(3) .. "[1]" .. protocol.encode({ n = 3 }))
    assert.is_nil(messages)
    assert.are.equal("undecodable frame: a JSON array, not an object", reason)
    assert.are.same({ { n = 1 }, { n = 2 } }, before)
    local again, same, none = decoder:push(protocol.encode({ n = 4 }))
    assert.is_nil(again)
    assert.are.equal(reason, same)
    assert.is_nil(none)
  end)

  it("refuses to encode a body over the limit, naming both sizes", function()
    local message = { pad = string.rep("x", 200) }
    local ok, err = pcall(protocol.encode, message, 100)
    assert.is_false(ok)
    assert.matches("frame of 210 bytes exceeds the 100-byte limit", err, 1, true)
    assert.are.equal(214, #protocol.encode(message, 210))
  end)
end)

describe("wsync.control.protocol.check_request", function()
  it("accepts a request built by protocol.request, with or without payload", function()
    assert.is_true(protocol.check_request(protocol.request(1, "info")))
    local bare = protocol.request(2, "info")
    bare.payload = nil
    assert.is_true(protocol.check_request(bare))
  end)

  it("refuses another protocol version with PROTOCOL_MISMATCH", function()
    local request = protocol.request(1, "info")
    request.protocol = protocol.VERSION + 1
    local ok, reason, code = protocol.check_request(request)
    assert.is_nil(ok)
    assert.are.equal("PROTOCOL_MISMATCH", code)
    assert.matches("peer speaks protocol 2, this side speaks 1", reason, 1, true)
    request.protocol = nil
    assert.are.equal("PROTOCOL_MISMATCH", select(3, protocol.check_request(request)))
  end)

  it("refuses a request without a numeric id or a string cmd", function()
    for _, broken in ipairs({ { id = "1", cmd = "info" }, { cmd = "info" }, { id = 1 }, { id = 1, cmd = 5 } }) do
      broken.protocol = protocol.VERSION
      local ok, reason, code = protocol.check_request(broken)
      assert.is_nil(ok)
      assert.are.equal("BAD_REQUEST", code)
      assert.matches("numeric id and a string cmd", reason, 1, true)
    end
  end)

  -- (Found by the fuzz target: a NaN or infinite id passed, and its answer
  -- could not be encoded, so the requester waited for its timeout.)
  it("refuses an id that is not an integer from 0 to 2^53, and answers it with id 0", function()
    for _, id in ipairs({ math.huge, -math.huge, 0 / 0, 1.5, -1, 2 ^ 53 + 2 }) do
      local request = protocol.request(id, "info")
      local ok, reason, code = protocol.check_request(request)
      assert.is_nil(ok)
      assert.are.equal("BAD_REQUEST", code)
      assert.matches("is not an integer from 0 to 2^53", reason, 1, true)
      local refusal = protocol.refusal(request, code, reason)
      assert.are.equal(0, refusal.id)
      assert.is_string(protocol.encode(refusal))
    end
    assert.is_true(protocol.check_request(protocol.request(2 ^ 53, "info")))
    assert.are.equal(7, protocol.refusal({ id = 7, cmd = {} }, "BAD_REQUEST", "no").id)
    -- (A cmd that is an object is named by its type, not by its address here.)
    assert.are.equal("table", protocol.refusal({ id = 7, cmd = {} }, "BAD_REQUEST", "no").cmd)
    assert.are.equal("5", protocol.refusal({ id = 7, cmd = 5 }, "BAD_REQUEST", "no").cmd)
  end)

  it("refuses a payload that is not an object", function()
    local request = protocol.request(1, "sleep")
    request.payload = "level 1"
    local ok, reason, code = protocol.check_request(request)
    assert.is_nil(ok)
    assert.are.equal("BAD_REQUEST", code)
    assert.matches("payload is not an object", reason, 1, true)
  end)
end)

describe("wsync.control.protocol.check_response", function()
  it("accepts a success and a failure that answer the request", function()
    assert.is_true(protocol.check_response(response(5, "info"), 5, "info"))
    local failed = protocol.failure({ id = 5, cmd = "info" }, "X", "why")
    assert.is_true(protocol.check_response(failed, 5, "info"))
  end)

  local cases = {
    { "another protocol", { protocol = 2 }, "peer speaks protocol 2" },
    { "no protocol", { protocol = ABSENT }, "peer speaks protocol nil" },
    { "another id", { id = 6 }, "response id 6 does not match request id 5" },
    { "another cmd", { cmd = "sleep" }, "response cmd sleep does not match request cmd info" },
    { "no ok", { ok = ABSENT }, "has no boolean ok" },
    { "ok not a boolean", { ok = "yes" }, "has no boolean ok" },
    { "ok=true with a string result", { result = "fine" }, "result of info is a string, not an object" },
    { "ok=true without a result", { result = ABSENT }, "result of info is a nil, not an object" },
    { "ok=false without an error", { ok = false, result = ABSENT }, "without an error {code, message}" },
    { "ok=false with a string error", { ok = false, error = "bad" }, "without an error {code, message}" },
    { "ok=false without a code", { ok = false, error = { message = "m" } }, "without an error {code, message}" },
    { "ok=false without a message", { ok = false, error = { code = "C" } }, "without an error {code, message}" },
    -- (Found with tests/fuzz: the error could not be reported.)
    { "ok=false with a table phase", { ok = false, error = { code = "C", message = "m", phase = {} } },
      "failed info response whose error.phase is a table, not a string" },
    { "ok=false with a boolean rank", { ok = false, error = { code = "C", message = "m", rank = true } },
      "failed info response whose error.rank is a boolean, not a number" },
  }
  for _, case in ipairs(cases) do
    local name, changes, expected = case[1], case[2], case[3]
    it("refuses a response with " .. name, function()
      local message = response(5, "info")
      for key, value in pairs(changes) do
        if value == ABSENT then
          message[key] = nil
        else
          message[key] = value
        end
      end
      local ok, reason = protocol.check_response(message, 5, "info")
      assert.is_nil(ok)
      assert.matches(expected, reason, 1, true)
    end)
  end
end)
