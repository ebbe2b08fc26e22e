-- wsync.publish.rollout: what a publication's loads ask of the runtime, on
-- a client stand-in that records the requests (no process).
local rollout_module = require("wsync.publish.rollout")

-- A rollout over a client that answers every request and keeps its payloads.
local function recording()
  local sent = {}
  local client = {
    request = function(_, cmd, payload)
      sent[#sent + 1] = { cmd = cmd, payload = payload }
      return { bytes = 0 }
    end,
  }
  return setmetatable({ client = client, chunks_sent = {} }, rollout_module.Rollout), sent
end

describe("wsync.publish.rollout load_chunk", function()
  it("sends a chunk's metadata once, and marks the plan's last chunk", function()
    local rollout, sent = recording()
    local plan = { chunks = { { tensors = { "a" } }, { tensors = { "b" } }, { tensors = { "c" } } } }
    for round = 1, 2 do
      for k = 1, 3 do
        rollout:load_chunk(plan, k, (k - 1) % 2 + 1)
      end
      for k = 1, 3 do
        local payload = sent[(round - 1) * 3 + k].payload
        assert.are.equal(k == 3 or nil, payload.last)
        assert.are.equal(round == 1 and plan.chunks[k].tensors or nil, payload.tensors)
      end
    end
  end)
end)
