-- The RL example on a GPU (bindings/python/examples/grpo.py; README, "On a
-- machine with a GPU"): grpo_tiny_cpu.lua's loop with vLLM. One FSDP2
-- trainer rank of the small Qwen3-MoE on GPU 0 runs this session in its own
-- process, generates through vLLM (TP1, the same GPU) between publications,
-- trains on the sampled tokens and publishes after every step. vLLM serves
-- models/qwen3-moe-small with dummy weights until the example publishes its
-- initial weights.
return extends("grpo_tiny_cpu.lua", {
  name = "grpo-tiny",
  description = "RL example: one FSDP2 rank (Qwen3-MoE, small) -> vLLM TP1 on one GPU, direct load, generating",
  backend = "cuda",
  runtime = { kind = "vllm", model = "models/qwen3-moe-small", load = "direct",
    -- (max_model_len: a prompt and its completion, 8 + 32 by the example's
    -- defaults.)
    vllm = { load_format = "dummy", enforce_eager = true, skip_tokenizer_init = true, seed = 0,
      gpu_memory_utilization = 0.25, max_model_len = 256 } },
  -- The direct path: no packed buffers; vLLM's TP worker copies the whole
  -- model in one chunk from where torch allocated the trainer's parameters.
  buffers = { direct = true },
  -- vLLM starts with its KV cache reserved, and the trainer generates only
  -- between its publish calls (Host.generate returns when its completions
  -- are done), so nothing generates while the weights move: no pause.
  bootstrap = {},
  schedule = { "offload_optimizer", "publish", "onload_optimizer" },
  timeouts = { startup = 600 },
})
