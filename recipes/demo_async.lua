-- Asynchronous RL on the host backend: two synthetic trainer ranks publish
-- into two rollout replicas of TP1 (the reference runtime's toy decoder) that
-- keep generating across trainer steps; each publication pauses every
-- replica in keep mode (two phases), moves the weights, and resumes them,
-- the requests held across it recomputing their KV caches under the new
-- weights. Four requests stream in every replica from the bootstrap on: each
-- round says how many tokens they produced and under which versions (their
-- spans), and the closing report's steps table gives each round's pause and
-- resume times. tests/bench/async_generation.lua measures it.
return extends("demo.lua", {
  name = "demo-async",
  description = "FSDP2 -> 2 x TP1 replicas generating across publications, paused in keep mode around each",
  trainer = { steps = 10 },
  runtime = { tp = 1, replicas = 2 },
  rollout = { stream = 4 },
  bootstrap = { { wake = { "kv_cache" } } },
  schedule = { { pause = "keep", kv = "recompute" }, "publish", "resume", "generate" },
})
