-- wsync.trainer.agent_api: the synchronous agent calls behind libwsync's ws_agent_*,
-- against a stand-in host in this process (an endpoint whose handlers answer
-- register and publish), so that each call's wait on the loop also serves
-- the stand-in.
local uv = require("luv")
local agent_api = require("wsync.trainer.agent_api")
local endpoint_module = require("wsync.control.endpoint")
local errors = require("wsync.errors")
local loop = require("wsync.loop")

local PUBLICATION_ID = string.rep("ab", 16)
local MANIFEST = string.rep("cd", 32)

describe("wsync.trainer.agent_api", function()
  local endpoint, registered, callback_first, publish_ms, peer_closed
  local memory = require("ffi").new("uint16_t[8]")

  before_each(function()
    registered, callback_first, publish_ms, peer_closed = nil, nil, nil, false
    endpoint = endpoint_module.listen({
      on_lost = function()
        peer_closed = true
      end,
      handlers_for = function(peer)
        return {
          register = function(payload)
            registered = payload
            return { plan = {}, model_version = 0 }
          end,
          publish = function(payload)
            if publish_ms then
              loop.sleep(publish_ms) -- (a publication that takes its time)
            end
            if callback_first then
              -- As the host's schedule does: a step callback before the answer.
              local ok, err = pcall(peer.request, peer, "callback", { name = callback_first }, 5)
              if not ok then
                errors.raise(err.code, "trainer rank 0: " .. err.message, { phase = "callback", rank = 0 })
              end
            end
            return { model_version = payload.step, publication_id = PUBLICATION_ID, manifest = MANIFEST, receipts = 2,
              report = '{"round":1,"steps":[]}' }
          end,
        }
      end,
    })
  end)

  after_each(function()
    endpoint:close()
    loop.run() -- completes the closes
  end)

  local function open()
    local handle, message, status = agent_api.open({ endpoint = endpoint.path, rank = 0, world = 1 })
    assert.is_table(handle, message)
    assert.is_nil(status)
    return handle
  end

  it("registers, waits for the host and publishes, each call returning when it is done", function()
    local handle = open()
    assert.is_true(handle:register_tensor("w", "bfloat16", { 4, 2 }, memory, 16, 0, 4))
    local calls = 0
    assert.is_true(handle:register_callback("offload_actor", function()
      calls = calls + 1
      return 0, true
    end))
    assert.is_true(handle:ready())
    assert.are.same({ "offload_actor" }, registered.callbacks)
    assert.are.same({ { name = "w", dtype = "bfloat16", shape = { 4, 2 }, rows = { 0, 4 } } }, registered.tensors)
    callback_first = "offload_actor"
    -- (The round's report as the host sent it: JSON text, passed on as it is.)
    -- (No generation asked: an empty one.)
    assert.are.same({ model_version = 7, publication_id = PUBLICATION_ID, manifest = MANIFEST, receipts = 2,
      report = '{"round":1,"steps":[]}', generation = "" }, handle:publish(7))
    -- (A generation request that is not a JSON object is refused before anything is sent.)
    local result, message, status = handle:publish(8, "[1, 2")
    assert.is_nil(result)
    assert.are.equal("EINVAL", status)
    assert.matches("publish: the generation request is not a JSON object", message, 1, true)
    assert.are.equal(1, calls)
    assert.is_true(handle:close())
    assert.is_true(handle:close(), "close twice")
  end)

  it("refuses calls out of order with ESTATE", function()
    local handle = open()
    local result, message, status = handle:publish(1)
    assert.is_nil(result)
    assert.are.equal("ESTATE", status)
    assert.matches("call ready first", message, 1, true)
    assert.is_true(handle:ready())
    result, message, status = handle:register_tensor("w", "bfloat16", { 4, 2 }, memory, 16, 0, 4)
    assert.is_nil(result)
    assert.are.equal("ESTATE", status)
    assert.matches("register_tensor w: the rank registered already", message, 1, true)
    handle:close()
    result, message, status = handle:publish(1)
    assert.is_nil(result)
    assert.are.equal("ESTATE", status)
    assert.matches("publish: the agent is closed", message, 1, true)
  end)

  it("fails publish with the host's error when a callback returns non-zero", function()
    local handle = open()
    handle:register_callback("offload_actor", function()
      return 3, true
    end)
    assert.is_true(handle:ready())
    callback_first = "offload_actor"
    local result, message, status = handle:publish(1)
    assert.is_nil(result)
    assert.are.equal("EFAILED", status)
    assert.are.equal("[phase callback, rank 0] trainer rank 0: callback 'offload_actor' failed (it returned 3) "
      .. "(CALLBACK_FAILED)", message)
    handle:close()
  end)

  it("fails the step of a callback that did not run to its end, whatever it returned", function()
    local handle = open()
    handle:register_callback("offload_actor", function()
      return 0, false -- (what a confirmed callback unwound before it ran reports)
    end)
    assert.is_true(handle:ready())
    callback_first = "offload_actor"
    local result, message, status = handle:publish(1)
    assert.is_nil(result)
    assert.are.equal("EFAILED", status)
    assert.are.equal("[phase callback, rank 0] trainer rank 0: callback 'offload_actor' was interrupted before it "
      .. "completed (it did not report done) (CALLBACK_FAILED)", message)
    handle:close()
  end)

  it("runs the interrupt check while a call waits, and goes on while it completes", function()
    local handle = open()
    local checks = 0
    assert.is_true(handle:set_interrupt_check(function()
      checks = checks + 1
      return 0, true
    end))
    assert.is_true(handle:ready())
    publish_ms = 5 * agent_api.CHECK_INTERVAL_MS
    assert.are.equal(3, handle:publish(3).model_version)
    assert.is_true(checks >= 2, "the check ran " .. checks .. " times")
    handle:close()
  end)

  it("abandons a call whose interrupt check did not complete: the rank leaves, the call fails at once", function()
    local handle = open()
    assert.is_true(handle:ready())
    local abandoned = nil
    agent_api.set_abandon_handler(function(path)
      abandoned = path
      return true
    end)
    finally(function()
      agent_api.set_abandon_handler(nil)
    end)
    assert.is_true(handle:set_interrupt_check(function()
      return 0, false -- (what a check unwound at its entry reports)
    end))
    publish_ms = 4 * agent_api.CHECK_INTERVAL_MS
    local started = uv.hrtime()
    local result, message, status = handle:publish(1)
    local waited_ms = (uv.hrtime() - started) / 1e6
    assert.is_nil(result)
    assert.are.equal("EFAILED", status)
    assert.are.equal("[rank 0] publish was interrupted (the trainer's interrupt check did not complete): the call "
      .. "was abandoned and this rank left its host; this host's session was stopped (INTERRUPTED)", message)
    assert.is_true(waited_ms < 3 * agent_api.CHECK_INTERVAL_MS, "publish returned after " .. waited_ms .. " ms")
    assert.are.equal(endpoint.path, abandoned)
    result, message, status = handle:publish(2)
    assert.is_nil(result)
    assert.are.equal("ESTATE", status)
    assert.matches("publish: the agent is unusable after an earlier failure: [rank 0] publish was interrupted",
      message, 1, true)
    loop.run_until(function()
      return peer_closed
    end)
    assert.is_true(handle:close())
  end)

  it("strips the position from a misuse wsync.trainer.agent caught", function()
    local handle = open()
    local result, message, status = handle:register_tensor("w", "bfloat16", { 4, 2 }, memory, 16, 2, 4)
    assert.is_nil(result)
    assert.are.equal("EINVAL", status)
    assert.are.equal("register_tensor w: rows [2, +4) outside dim 0 of 4", message)
    handle:close()
  end)

  it("refuses, before it starts anything, to run from inside the loop", function()
    local function handles()
      local count = 0
      uv.walk(function()
        count = count + 1
      end)
      return count
    end
    local before = handles()
    local outcome = nil
    loop.spawn(function()
      outcome = { agent_api.open({ endpoint = endpoint.path, rank = 0, world = 1 }) }
    end)
    assert.is_nil(outcome[1])
    assert.are.equal("ESTATE", outcome[3])
    assert.matches("call it from outside the loop", outcome[2], 1, true)
    assert.are.equal(before, handles(), "it opened a connection")
  end)
end)
