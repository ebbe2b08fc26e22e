-- The demo on one GPU, the cuda backend: one synthetic trainer rank whose
-- shards and values live on the GPU publishes three model versions of the
-- tiny Qwen3-MoE into a TP1 reference runtime on the same GPU, through a
-- packed buffer from cudaMalloc that the TP worker maps once over CUDA IPC;
-- every chunk is one batched copy kernel on each side. After each
-- publication the TP worker checks every resident slice against the
-- synthetic values on the device.
return extends("demo.lua", {
  name = "demo-cuda",
  description = "FSDP1 -> TP1 Qwen3-MoE (tiny) on one GPU, three verified publications",
  backend = "cuda",
  trainer = { ranks = 1 },
  runtime = { tp = 1 },
  -- (The demo's 64 MiB budget is for its data alone; on a GPU each process
  -- also holds its CUDA context, about 0.5 GiB: wsync.plan.schedule.)
  memory = { device_bytes = 2 * 1024 * 1024 * 1024 },
})
