-- The demo, wsync's main job on the host backend: two synthetic FSDP trainer
-- ranks holding a tiny Qwen3-MoE in the transformers-v5 layout (packed
-- experts, uneven dim-0 shards) publish three model versions into a TP2
-- reference runtime, through shared-memory packed buffers, following the
-- usual memory schedule. After each publication every resident TP slice is
-- checked against values computed independently from the generator and the
-- loader plan.
return {
  name = "demo",
  description = "FSDP2 -> TP2 Qwen3-MoE (tiny) on the host backend, three verified publications",
  backend = "host",
  model = { family = "qwen3_moe", preset = "tiny" },
  trainer = { kind = "synthetic", ranks = 2, steps = 3 },
  runtime = { kind = "reference", tp = 2, respawn = false },
  -- Small buffers so that the tiny model takes several chunks and the two
  -- buffers alternate.
  buffers = { bytes = 160 * 1024, count = 2 },
  memory = {
    device_bytes = 64 * 1024 * 1024,
    optimizer_factor = 6,
    kv_bytes = 1024 * 1024,
  },
  -- Once, before the first publication: the rollout's initial weights go to
  -- host memory (level 1) so that training has the device.
  bootstrap = { { sleep = 1 } },
  -- Around every publication (the reference runtime does not generate, so
  -- there is no "generate" step).
  schedule = {
    "offload_optimizer",
    { wake = { "weights" } },
    "publish",
    "offload_actor",
    { wake = { "kv_cache" } },
    { sleep = 2 },
    "onload_actor",
    "onload_optimizer",
  },
  timeouts = { startup = 30, load_chunk = 30, fill = 30 },
  verify = true,
}
