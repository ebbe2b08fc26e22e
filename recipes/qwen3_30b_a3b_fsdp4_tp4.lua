-- Qwen3-30B-A3B, FSDP4 trainer -> vLLM TP4, colocated on four H200 (cuda).
-- The trainer is external: four trainer ranks embed wsync's agent and call
-- publish() after each optimizer step. `wsync check` prints the plan.
local GiB = 1024 * 1024 * 1024
return {
  name = "qwen3-30b-a3b-fsdp4-tp4",
  description = "Qwen3-30B-A3B BF16, FSDP4 -> TP4 on 4 x H200",
  backend = "cuda",
  model = { family = "qwen3_moe", preset = "qwen3-30b-a3b" },
  trainer = { kind = "external", ranks = 4 },
  -- vLLM serves the model of recipes/models/qwen3-30b-a3b (its config.json;
  -- with load_format "dummy" vLLM needs no checkpoint: wsync publishes it).
  -- vLLM starts while the trainer holds all of its share (114 GiB a device:
  -- bf16 parameters, gradients, fp32 master weights and Adam moments), and
  -- reserves gpu_memory_utilization of the device at once: 0.16 (22.4 GiB:
  -- its 14.2 GiB of TP4 weights, the rest KV cache) is what fits beside it.
  runtime = { kind = "vllm", tp = 4, respawn = false, model = "models/qwen3-30b-a3b", load = "direct",
    vllm = { load_format = "dummy", gpu_memory_utilization = 0.16 } },
  -- The largest trainer tensor (a layer's packed gate_up_proj) is 768 MiB.
  buffers = { bytes = 1 * GiB, count = 2 },
  memory = {
    device_bytes = 140 * GiB,
    optimizer_factor = 6, -- FP32 master weights and two Adam moments per BF16 parameter
    headroom_bytes = 2 * GiB,
  },
  bootstrap = { { sleep = 1 } },
  schedule = {
    "offload_optimizer",
    { wake = { "weights" } },
    "publish",
    "offload_actor",
    { wake = { "kv_cache" } },
    "generate",
    { sleep = 2 },
    "onload_actor",
    "onload_optimizer",
  },
  timeouts = { load_chunk = 120, fill = 120, finish_update = 300 },
}
