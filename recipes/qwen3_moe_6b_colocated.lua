-- A Qwen3-MoE of 5.8 B parameters (recipes/models/qwen3-moe-6b) that fits
-- colocated on one H200 only because of the memory schedule: one FSDP2 rank
-- training in mixed precision (bfloat16 parameters, float32 master weights
-- and AdamW moments: 14 bytes a parameter, 76 GiB) and vLLM TP1 reserving 0.7
-- of the device (98 GiB) hold 1.25 times the device together. The schedule
-- gives each the device in turn, and one publish call is the whole switch
-- (Agent.publish(generate=...)): the trainer's optimizer state and actor
-- leave, the new weights go in, vLLM's KV cache is woken, the rank's prompts
-- are generated, vLLM sleeps and the trainer's memory comes back. The
-- trainer makes its optimizer state before the runtime starts and moves it
-- to host memory first (memory.optimizer_at_start = false), as vLLM takes
-- its share at its start. tests/bench/colocated.py runs it; `wsync check`
-- refuses it without the offload steps.
return {
  name = "qwen3-moe-6b-colocated",
  description = "Qwen3-MoE 5.8B, one FSDP2 rank (mixed precision) and vLLM TP1 on one H200, switched by the schedule",
  backend = "cuda",
  model = { family = "qwen3_moe", config = {
    vocab_size = 32000, hidden_size = 2048, moe_intermediate_size = 768, num_hidden_layers = 24,
    num_attention_heads = 16, num_key_value_heads = 4, head_dim = 128, num_experts = 48,
    num_experts_per_tok = 8, tie_word_embeddings = false,
  } },
  -- (The initial weights' publication, then one per step: the benchmark
  -- sets steps to its --steps + 1.)
  trainer = { kind = "external", ranks = 1, steps = 11 },
  runtime = { kind = "vllm", tp = 1, model = "models/qwen3-moe-6b", load = "direct",
    vllm = { load_format = "dummy", enforce_eager = true, skip_tokenizer_init = true, seed = 0,
      gpu_memory_utilization = 0.7, max_model_len = 512 } },
  -- Packed buffers: the trainer's storage leaves the device between
  -- publications (offload_actor), which the direct path cannot follow.
  buffers = { bytes = 512 * 1024 * 1024, count = 2 },
  memory = {
    device_bytes = 150109880320, -- (an H200 as CUDA counts it)
    optimizer_factor = 6, -- (float32 master weights and two moments per bfloat16 parameter)
    gradients = false, -- (freed by each optimizer step: none between publications)
    optimizer_at_start = false,
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
  timeouts = { startup = 900, callback = 300, init_weights = 300, load_chunk = 120, finish_update = 120 },
}
