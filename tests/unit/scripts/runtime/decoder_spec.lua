-- The reference runtime's toy decoder: deterministic tokens from the weights'
-- digest and the context, steps only while generation is allowed, version
-- spans that split where the committed version changed, polls that return
-- what is new.
local async = require("tests.helpers.async")
local decoder_module = require("wsync.runtime.decoder")
local error_of = require("tests.helpers.errors").error_of
local loop = require("wsync.loop")

local function decoder(state)
  return decoder_module.new({
    vocab = 1000, step_ms = 1,
    allowed = function()
      return state.allowed
    end,
    version = function()
      return state.version
    end,
    weights = function()
      return state.weights
    end,
  })
end

-- Waits (in a coroutine) until request `id` of `d` has at least `count`
-- tokens, however slowly this machine runs the decoder's timer.
local function wait_tokens(d, id, count)
  local deadline = require("luv").now() + 10000
  while #d.requests[id].tokens < count do
    assert(require("luv").now() < deadline, "the decoder produced no token in 10 s")
    loop.sleep(1)
  end
end

describe("wsync.runtime.decoder", function()
  it("emits tokens that depend on the weights' digest and the context only", function()
    local a = decoder_module.next_token("w1", { 1, 2, 3 }, 1000)
    assert.are.equal(a, decoder_module.next_token("w1", { 1, 2, 3 }, 1000))
    assert.are_not.equal(a, decoder_module.next_token("w2", { 1, 2, 3 }, 1000))
    assert.are_not.equal(a, decoder_module.next_token("w1", { 1, 2, 4 }, 1000))
    assert.is_true(a >= 0 and a < 1000)
  end)

  it("steps only while allowed, and splits a request's spans where the version changed", function()
    async.run_async(function()
      local state = { allowed = true, version = 3, weights = "w" }
      local d = decoder(state)
      local id = d:submit({ { prompt = { 7 }, max_tokens = 1000 } })[1]
      wait_tokens(d, id, 2)
      state.allowed = false
      loop.sleep(5)
      local paused = d:poll({ id })[1]
      loop.sleep(20)
      assert.are.same({}, d:poll({ id })[1].tokens, "no token while generation is not allowed")
      state.version, state.weights, state.allowed = 4, "w'", true
      wait_tokens(d, id, paused.generated + 1)
      local resumed = d:poll({ id })[1]
      assert.are.equal(paused.generated, resumed.first_token)
      assert.are.equal(2, #resumed.spans)
      assert.are.same({ version = 3, first_token = 0, last_token = paused.generated - 1 }, resumed.spans[1])
      assert.are.equal(4, resumed.spans[2].version)
      assert.are.equal(paused.generated, resumed.spans[2].first_token)
      assert.are.equal(3, resumed.model_version, "stamped with its dispatch's version")
      d:close()
    end)
  end)

  it("pauses as vLLM does: abort ends what is in flight, wait lets it finish, keep holds it", function()
    async.run_async(function()
      local state = { allowed = true, version = 0, weights = "w" }
      local d = decoder(state)
      local long = d:submit({ { prompt = { 1 }, max_tokens = 60000 } })[1]
      wait_tokens(d, long, 1)
      local aborted = d:pause("abort")
      assert.are.same({ mode = "abort", aborted = 1, finished = 0, held = 0 }, aborted)
      local ended = d:poll({ long })[1]
      assert.is_true(ended.done)
      assert.are.equal("aborted", ended.finish)
      assert.are.equal("STATE_REFUSED", error_of(d.pause, d, "keep").code)
      d:resume()
      assert.are.equal("STATE_REFUSED", error_of(d.resume, d).code)

      local short = d:submit({ { prompt = { 2 }, max_tokens = 20 } })[1]
      assert.are.same({ mode = "wait", aborted = 0, finished = 1, held = 0 }, d:pause("wait"))
      local finished = d:poll({ short })[1]
      assert.are.equal(20, finished.generated)
      assert.are.equal("length", finished.finish)
      d:resume()

      local held = d:submit({ { prompt = { 3 }, max_tokens = 60000 } })[1]
      wait_tokens(d, held, 1)
      assert.are.equal(1, d:pause("keep", "keep").held)
      local before = d:poll({ held })[1].generated
      loop.sleep(10)
      assert.are.equal(before, d:poll({ held })[1].generated, "held: no token while paused")
      state.version, state.weights = 1, "w'"
      assert.are.same({ held = 1, kv = "kept" }, d:resume())
      wait_tokens(d, held, before + 1)
      local spans = d:poll({ held })[1].spans
      assert.are.equal(2, #spans)
      assert.is_nil(spans[1].kv)
      assert.are.same({ version = 1, first_token = before, kv = "kept" },
        { version = spans[2].version, first_token = spans[2].first_token, kv = spans[2].kv })
      assert.are.equal("INVALID_ARGUMENT", error_of(d.pause, d, "later").code)
      assert.are.equal("INVALID_ARGUMENT", error_of(d.pause, d, "keep", "forget").code)
      d:close()
    end)
  end)

  it("refuses bad requests before it queues any", function()
    local d = decoder({ allowed = false, version = 0, weights = "w" })
    assert.are.equal("INVALID_ARGUMENT", error_of(d.submit, d, { { prompt = {} } }).code)
    assert.are.equal("INVALID_ARGUMENT", error_of(d.submit, d, { { prompt = { 1 }, max_tokens = 0 } }).code)
    assert.are.equal("INVALID_ARGUMENT", error_of(d.submit, d, { { prompt = { 1.5 } } }).code)
    assert.are.equal(0, d:in_flight())
    assert.are.equal("INVALID_ARGUMENT", error_of(d.poll, d, { 99 }).code)
    d:close()
  end)
end)
