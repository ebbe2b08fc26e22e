-- Prints the canonical tensors of a plan as JSON (name, shape, elements), in
-- stream order, for tests/bench/vllm_peer.py (vLLM's packer on the same
-- tensors).
--
--   wsync tests/bench/canonical.lua [PRESET]     (default qwen3-30b-a3b)
local cjson = require("cjson")
local plan_module = require("wsync.plan")

local plan = plan_module.build({ family = "qwen3_moe", config = arg[1] or "qwen3-30b-a3b" },
  { bytes = 2 ^ 40, count = 1 })
local out = {}
for index, tensor in ipairs(plan.canonical) do
  out[index] = { name = tensor.name, shape = tensor.shape, elements = tensor.bytes / 2 }
end
io.stdout:write(cjson.encode(out), "\n")
