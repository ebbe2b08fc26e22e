-- The reference runtime's generation around publications: its toy decoder
-- (wsync.runtime.decoder) emits what the resident weights make it emit, so a
-- publication visibly changes the tokens; a request that streams across a
-- publication (held by a keep-mode pause) carries version spans saying which
-- version produced which of its tokens, and how its KV cache went on.
local cjson = require("cjson")
local fixtures = require("tests.helpers.fixtures")
local process = require("tests.helpers.process")

local SCRIPT = [[
local cjson = require("cjson")
local recipe = require("wsync.recipe").load(...)
local s = require("wsync.publish.session").open(recipe)
s:wait_publish()
local rollout = s.rollout
local prompt = { { 3, 1, 4, 1, 5 } }
local before = rollout:request("generate", { prompts = prompt, sampling = { max_tokens = 8 } })
local id = rollout:request("submit", { requests = { { prompt = { 9, 9 }, max_tokens = 60000 } } }).ids[1]
-- Until the request has tokens of this version, and after the round of the
-- next (however slowly this machine runs the decoder).
local function until_tokens(count)
  repeat
    require("wsync.loop").sleep(5)
  until rollout:request("poll", { ids = { id } }).requests[1].generated >= count
end
until_tokens(3)
local report = s:round()
until_tokens(rollout:request("poll", { ids = { id } }).requests[1].generated + 3)
local streamed = rollout:request("poll", { ids = { id } }).requests[1]
local after = rollout:request("generate", { prompts = prompt, sampling = { max_tokens = 8 } })
io.stdout:write("RESULT ", cjson.encode({ before = before, after = after, streamed = streamed,
  committed = report.model_version }), "\n")
io.stdout:flush()
s:close()
]]

describe("generation in the reference runtime around publications", function()
  it("changes with the published weights, and stamps a streaming request's tokens with version spans", function()
    local path = os.tmpname()
    local file = assert(io.open(path, "w"))
    file:write(SCRIPT)
    file:close()
    local result = process.wsync({ path, fixtures.recipes .. "/generate_across.lua" }, nil, { timeout = 60000 })
    os.remove(path)
    assert.are.equal(0, result.code, result.stderr)
    local found = assert(result.stdout:match("\nRESULT ([^\n]+)"), result.stdout)
    local got = cjson.decode(found)
    assert.are.equal(1, got.committed)
    assert.are.equal(0, got.before.model_version)
    assert.are.equal(1, got.after.model_version)
    assert.are_not.same(got.before.outputs[1].token_ids, got.after.outputs[1].token_ids,
      "the published weights change what the decoder emits")
    local spans = got.streamed.spans
    assert.are.equal(2, #spans, cjson.encode(spans))
    assert.are.equal(0, spans[1].version)
    assert.are.equal(1, spans[2].version)
    assert.are.equal(0, spans[1].first_token)
    assert.are.equal(spans[1].last_token + 1, spans[2].first_token, "the spans are contiguous")
    assert.is_true(spans[1].last_token >= 1 and spans[2].last_token > spans[2].first_token)
    assert.are.equal(spans[2].last_token + 1, got.streamed.generated)
    assert.are.equal(0, got.streamed.model_version, "stamped with the version of its dispatch")
    assert.are.equal("recomputed", spans[2].kv, "held across the publication, its KV cache recomputed")
  end)
end)
