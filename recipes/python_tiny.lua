-- One trainer rank that embeds wsync and runs the session in its own process
-- (Python's wsync.Host(recipe); the example of README.md's "Embedding wsync
-- in a PyTorch trainer"): the demo's tiny Qwen3-MoE, a TP1 reference runtime
-- on the host backend, three publications. The trainer's values are its own,
-- so the check of resident slices against wsync's synthetic values is off.
return extends("demo.lua", {
  name = "python-tiny",
  description = "one embedding trainer rank -> TP1 Qwen3-MoE (tiny) on the host backend, in-process session",
  trainer = { kind = "external", ranks = 1 },
  runtime = { tp = 1 },
  verify = false,
})
