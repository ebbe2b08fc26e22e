-- wsync.publish.console: the session's lines on stdout, composed from its
-- facts (the shapes, a publication, the streaming requests, the closing
-- report), and a wait on a condition that says what it waits for.
local async = require("tests.helpers.async")
local console = require("wsync.publish.console")
local loop = require("wsync.loop")
local captured = require("tests.helpers.stdout").captured

local RECIPE = { name = "demo", runtime = { kind = "reference" }, buffers = {} }
local PLAN = { family = "qwen3_moe", canonical = { 1, 2, 3 }, bytes = 405248, chunks = { 1, 2 }, manifest = "m1",
  buffer_count = 2, buffer_bytes = 163840 }

-- A committed publication's report (wsync.Publication:report()).
local function publication(verified)
  return { model_version = 2, step = 5, bytes = 405248, chunks = 3, gbps = 0.0925, verified = verified,
    timings = { total = 0.0125, fill = 0.0031, load = 0.0062, finish = 0.0004 }, receipts = { {}, {} } }
end

describe("wsync.publish.console", function()
  it("says a line on stdout, prefixed", function()
    assert.are.equal("wsync: 2 of 3 ranks\n", captured(console.say, "%d of %d ranks", 2, 3))
  end)

  it("names the runtime's and the buffers' shape", function()
    assert.are.equal("TP2", console.runtime_shape({ tp = 2 }))
    assert.are.equal("TP2", console.runtime_shape({ tp = 2, replicas = 1 }))
    assert.are.equal("2 x TP1", console.runtime_shape({ tp = 1, replicas = 2 }))
    assert.are.equal("buffers 2 x 160.00 KiB", console.buffers_shape(RECIPE, PLAN))
    assert.are.equal("direct: no packed buffers, the TP workers read the trainer's storage",
      console.buffers_shape({ buffers = { direct = true } }, PLAN))
  end)

  it("sums up a publication, with the resident check it had", function()
    local line = "model version 2 (step 5): 395.75 KiB in 3 chunks, 12.5 ms (fill 3.1, load 6.2, finish 0.4), "
      .. "0.09 GB/s; receipts 2/2"
    assert.are.equal(line, console.publication(publication()))
    assert.are.equal(line .. "; resident weights verified (42 tensors on 2 workers)",
      console.publication(publication({ tensors = 42, workers = 2 })))
    assert.are.equal(line .. "; resident weights verified on the device (8 slices, 4096 elements on 2 workers)",
      console.publication(publication({ slices = 8, elements = 4096, workers = 2 })))
  end)

  it("names the last three spans of a request's versions", function()
    local spans = {}
    for version = 1, 4 do
      spans[version] = { version = version, first_token = 2 * version - 1, last_token = 2 * version,
        kv = version == 4 and "recomputed" or nil }
    end
    assert.are.equal("", console.spans(nil))
    assert.are.equal("v1 tokens 1-2", console.spans({ spans[1] }))
    assert.are.equal("..., v2 tokens 3-4, v3 tokens 5-6, v4 tokens 7-8 (kv recomputed)", console.spans(spans))
  end)

  it("says what streaming requests produced, over every replica", function()
    assert.are.equal("round 3: 0 streaming requests produced 0 tokens since the last round",
      console.stream(3, { requests = {} }))
    local first = { id = 7, tokens = { 1, 2, 3 }, spans = { { version = 2, first_token = 1, last_token = 3 } } }
    assert.are.equal("round 1: 3 streaming requests produced 6 tokens since the last round; request 7's versions: "
      .. "v2 tokens 1-3", console.stream(1, { replicas = { { requests = { first, { tokens = { 4 } } } },
        { requests = { { tokens = { 5, 6 } } } } } }))
    -- (The first request with a token: the first round may end before every
    -- request's first token.)
    local empty = { id = 1, tokens = {}, spans = {} }
    assert.are.equal("round 1: 2 streaming requests produced 3 tokens since the last round; request 7's versions: "
      .. "v2 tokens 1-3", console.stream(1, { requests = { empty, first } }))
    assert.are.equal("round 1: 1 streaming requests produced 0 tokens since the last round; none has a token yet",
      console.stream(1, { requests = { empty } }))
  end)

  it("composes the closing report around the run report's table", function()
    local about = { recipe = RECIPE, plan = PLAN, topology = { world = 2, tp = 2 } }
    local receipt = { publication_id = "ab12", model_version = 2, uuid = "GPU-1", resident_tensors = 42,
      manifest = "m2" }
    local rounds = { { committed = true, receipts = { receipt } }, { committed = false } }
    assert.are.same({
      "closing report: recipe demo, qwen3_moe, 2 trainer ranks -> TP2 reference runtime",
      "  plan: 3 canonical tensors, 395.75 KiB, 2 chunks (buffers 2 x 160.00 KiB), manifest m1",
      "  steps of each round:",
      "  synthetic trainer processes: rank 0 exited with code 0",
      "  last receipt (TP rank 0): publication ab12, version 2, device GPU-1, 42 resident tensors, manifest m2",
    }, console.closing(about, { "steps of each round:" }, rounds, "rank 0 exited with code 0"))
    local lines = console.closing(about, {}, {}, nil)
    assert.are.equal(2, #lines, "no trainer processes and no committed round: nothing said of them")
  end)

  describe("wait_for", function()
    local saved_after
    before_each(function()
      saved_after = loop.PROGRESS_AFTER
    end)
    after_each(function()
      loop.PROGRESS_AFTER = saved_after
    end)

    it("returns true once the predicate holds, false when the time is up, saying what it waits for", function()
      loop.PROGRESS_AFTER = 0.02
      local results = {}
      local said = captured(async.run_async, function()
        local condition, done = loop.condition(), false
        loop.after(10, function()
          done = true
          condition:notify()
        end)
        results.held = console.wait_for(condition, 5, function()
          return done
        end)
        results.expired = console.wait_for(condition, 0.1, function()
          return false
        end, function()
          return "the ranks to leave", "(timeouts.shutdown)"
        end)
      end)
      assert.is_true(results.held)
      assert.is_false(results.expired)
      assert.matches("^wsync: waiting for the ranks to leave: 0 s so far, deadline 0.1 s %(timeouts.shutdown%)\n",
        said)
    end)
  end)
end)
