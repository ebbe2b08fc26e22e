-- Smoke recipe: exercises the host foundation end to end without a model.
-- It hashes a manifest of a tiny Qwen3-MoE-shaped record list, round-trips
-- bytes through a shared-memory buffer, reads the host backend's device
-- identities, and prints what it saw.
local wsync = require("wsync")

return {
  name = "smoke",
  description = "host foundation smoke test: manifest, shared memory, devices",
  backend = "host",
  params = {
    ranks = 2,
    buffer_bytes = 1048576,
    greeting = "hello from the smoke recipe",
  },
  run = function(ctx)
    local params = ctx.params
    local manifest = wsync.native.manifest.of({
      { "model.embed_tokens.weight", "bfloat16", { 1024, 64 } },
      { "model.layers.0.self_attn.q_proj.weight", "bfloat16", { 128, 64 } },
      { "model.norm.weight", "bfloat16", { 64 } },
    })
    print(string.format("smoke: %s", params.greeting))
    print(string.format("smoke: manifest %s (%d records, %d bytes)",
      manifest.digest, manifest.count, manifest.bytes))

    local buffer = assert(wsync.native.shm.create(params.buffer_bytes))
    local peer = assert(wsync.native.shm.open(buffer:name()))
    buffer:write(0, "wsync")
    assert(peer:read(0, 5) == "wsync", "shared memory did not round-trip")
    peer:close()
    buffer:close()
    print(string.format("smoke: shared memory round-trip ok (%d bytes)", params.buffer_bytes))

    for rank = 0, params.ranks - 1 do
      local device = assert(wsync.native.device.query("host", rank))
      print(string.format("smoke: rank %d -> host device %s", rank, device.uuid))
    end
    print("smoke: ok")
  end,
}
