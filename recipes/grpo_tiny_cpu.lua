-- The RL example (bindings/python/examples/grpo.py) on any machine, for its
-- plumbing only: one FSDP2 trainer rank of a small Qwen3-MoE (transformers,
-- random init, on the CPU) runs this session in its own process
-- (wsync.Host(recipe)), generates through the rollout runtime between
-- publications, trains on what it generated and publishes after every step.
-- Here the runtime is wsync's reference runtime on the host backend, whose toy
-- decoder generates from a digest of the weights, not from the model: nothing
-- is learned. recipes/grpo_tiny.lua is the same loop with vLLM on a GPU.
return {
  name = "grpo-tiny-cpu",
  description = "RL example: one FSDP2 rank (Qwen3-MoE, small, CPU) -> TP1 reference runtime, generating in between",
  backend = "host",
  -- recipes/models/qwen3-moe-small/config.json, which the trainer builds its
  -- model from (and vLLM serves on the GPU).
  model = { family = "qwen3_moe", config = {
    vocab_size = 2048, hidden_size = 256, moe_intermediate_size = 128, num_hidden_layers = 2,
    num_attention_heads = 4, num_key_value_heads = 2, head_dim = 64, num_experts = 8,
    tie_word_embeddings = false,
  } },
  -- One publication of the initial weights, then one per RL step: the
  -- example sets steps to its --steps + 1.
  trainer = { kind = "external", ranks = 1, steps = 51 },
  runtime = { kind = "reference", tp = 1 },
  -- The model's 5.76 MiB in one chunk.
  buffers = { bytes = 8 * 1024 * 1024, count = 1 },
  -- The optimizer's state leaves the trainer's device while the weights move
  -- (the trainer's callbacks, wsync.OptimizerOffload). The reference runtime
  -- starts with its KV cache free: woken once, it stays reserved for the
  -- trainer's generation between publications (wsync.Host.generate), which
  -- is paused around each publication (wsync check refuses to publish while
  -- generation could run).
  bootstrap = { { wake = { "kv_cache" } } },
  schedule = { "offload_optimizer", { pause = "keep" }, "publish", "resume", "onload_optimizer" },
  verify = false,
}
