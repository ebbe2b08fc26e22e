-- What the vllm runtime refuses from the recipe alone (wsync.runtime.vllm's
-- unavailable), before it looks at a model directory or a Python: each with
-- the field to blame.
local vllm = require("wsync.runtime.vllm")

local function recipe(overrides)
  local base = {
    backend = "cuda", verify = false,
    runtime = { kind = "vllm", tp = 1, model = "/nonexistent-model-dir", load = "direct" },
    buffers = { bytes = 1024 * 1024, count = 2 },
  }
  for key, value in pairs(overrides) do
    if type(value) == "table" and type(base[key]) == "table" then
      for inner, item in pairs(value) do
        base[key][inner] = item
      end
    else
      base[key] = value
    end
  end
  return base
end

describe("the vllm runtime's refusals from the recipe", function()
  it("refuses verify = true, which checks synthetic values on a runtime's own storage", function()
    local why, field = vllm.unavailable(recipe({ verify = true }))
    assert.are.equal("verify", field)
    assert.matches("verify = true checks resident slices against wsync's synthetic values", why, 1, true)
  end)

  it("refuses verify = \"values\" with the native load", function()
    local why, field = vllm.unavailable(recipe({ verify = "values", runtime = { load = "native" } }))
    assert.are.equal("verify", field)
    assert.matches("it needs load = \"direct\"", why, 1, true)
  end)

  it("refuses the direct path from the trainer's storage with the native load, which reads packed buffers", function()
    local why, field = vllm.unavailable(recipe({ buffers = { direct = true }, runtime = { load = "native" } }))
    assert.are.equal("buffers.direct", field)
    assert.matches("vLLM's own packed update (load = \"native\") reads packed buffers", why, 1, true)
  end)

  it("takes the direct path with the direct load, and then looks for the model's directory", function()
    local why, field = vllm.unavailable(recipe({ buffers = { direct = true } }))
    assert.are.equal("runtime.model", field)
    assert.matches("/nonexistent-model-dir/config.json", why, 1, true)
  end)
end)

describe("the vllm runtime's channel to its TP workers", function()
  it("is wsync's socket for the direct loader and vLLM's collective_rpc for native, unless the recipe says", function()
    local channel = vllm.channel
    assert.are.equal("socket", channel(nil, nil))
    assert.are.equal("socket", channel("direct", nil))
    assert.are.equal("rpc", channel("native", nil))
    assert.are.equal("rpc", channel("direct", "rpc"))
    assert.are.equal("socket", channel("native", "socket"))
  end)
end)
