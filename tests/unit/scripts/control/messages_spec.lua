-- wsync.control.messages: every control message between the host and an agent, and
-- the runtime results the host reads, are checked before a field is read.
local messages = require("wsync.control.messages")

local function registration()
  return {
    rank = 1, world = 2, hostname = "node", pid = 42,
    device = { backend = "host", index = 1, uuid = "0a1b-2c3d", free_bytes = 1024 },
    tensors = { { name = "model.norm.weight", dtype = "bfloat16", shape = { 64 }, rows = { 32, 32 } } },
    callbacks = { "offload_actor" },
  }
end

describe("wsync.control.messages.check", function()
  it("passes a well-formed register and fills the defaults", function()
    local payload = registration()
    payload.callbacks = nil
    local checked, reason = messages.check(messages.to_host, "register", payload)
    assert.is_nil(reason)
    assert.are.same({}, checked.callbacks)
    assert.are.equal("0a1b-2c3d", checked.device.uuid)
  end)

  local bad = {
    { "without a device", function(p) p.device = nil end, "register: field 'device': is required" },
    { "with a device without a uuid", function(p) p.device.uuid = nil end,
      "register: field 'device.uuid': is required" },
    { "with a string rank", function(p) p.rank = "1" end, "register: field 'rank': expected a number, got \"1\"" },
    { "with a negative rank", function(p) p.rank = -1 end, "register: field 'rank': must be at least 0, got -1" },
    { "with a fractional world", function(p) p.world = 1.5 end,
      "register: field 'world': expected an integer, got 1.5" },
    { "with an unknown backend", function(p) p.device.backend = "tpu" end,
      "register: field 'device.backend': expected one of host, cuda, got \"tpu\"" },
    { "with a tensor without a name", function(p) p.tensors[1].name = nil end,
      "register: field 'tensors[1].name': is required" },
    { "with rows past dim 0", function(p) p.tensors[1].rows = { 32, 33 } end,
      "register: field 'tensors[1].rows': rows [32, +33) run past dim 0 of 64" },
    { "with nine dims", function(p) p.tensors[1].shape = { 1, 1, 1, 1, 1, 1, 1, 1, 1 } end,
      "register: field 'tensors[1].shape': takes at most 8 entries, has 9" },
    { "with a table for a callback name", function(p) p.callbacks = { {} } end,
      "register: field 'callbacks[1]': expected a string, got a table" },
    { "with an unknown field", function(p) p.extra = true end,
      "register: field 'extra': unknown field (known: callbacks, device, hostname, pid, rank, tensors, world)" },
  }
  for _, case in ipairs(bad) do
    it("refuses a register " .. case[1] .. ", naming the field", function()
      local payload = registration()
      case[2](payload)
      local checked, reason = messages.check(messages.to_host, "register", payload)
      assert.is_nil(checked)
      assert.are.equal(case[3], reason)
    end)
  end

  it("refuses a payload that is not a table", function()
    local checked, reason = messages.check(messages.to_host, "publish", "step 1")
    assert.is_nil(checked)
    assert.are.equal("publish: expected a table, got \"step 1\"", reason)
  end)

  it("refuses an agent's verify result without a manifest, and a fill request without a buffer", function()
    assert.are.equal("verify: field 'manifest': is required",
      select(2, messages.check(messages.from_agent, "verify", { tensors = 3 })))
    assert.are.equal("fill: field 'buffer': is required",
      select(2, messages.check(messages.to_agent, "fill", { chunk = 1, slots = {} })))
  end)

  it("takes a publication's begin with its first fill only, and refuses a begin without its publication id",
    function()
      local id = string.rep("0f", 16)
      local checked = messages.check(messages.to_agent, "fill", { chunk = 1, buffer = 1,
        begin = { family = "qwen3_moe", publication_id = id } })
      assert.are.equal(id, checked.begin.publication_id)
      assert.are.equal("fill: field 'begin.publication_id': is required",
        select(2, messages.check(messages.to_agent, "fill", { chunk = 1, buffer = 1, begin = { family = "x" } })))
      assert.is_nil(messages.to_agent.begin)
    end)

  it("refuses a last fill's answer whose consumed manifest is not one", function()
    local manifest = string.rep("ab", 32)
    local checked = messages.check(messages.from_agent, "fill", { bytes = 8, rank = 0,
      consumed = { manifest = manifest, tensors = 2 } })
    assert.are.equal(manifest, checked.consumed.manifest)
    assert.are.equal("fill: field 'consumed.tensors': is required",
      select(2, messages.check(messages.from_agent, "fill", { bytes = 8, consumed = { manifest = manifest } })))
    assert.is_nil(messages.check(messages.from_agent, "fill", { bytes = 8, consumed = { manifest = "ab",
      tensors = 2 } }))
  end)

  it("refuses a runtime's info without workers and a finish without receipts", function()
    assert.are.equal("info: field 'workers': is required", select(2, messages.check(messages.from_runtime, "info",
      { protocol = 1, tp_world = 1, state = {} })))
    assert.are.equal("finish_update: field 'receipts': is required",
      select(2, messages.check(messages.from_runtime, "finish_update", { model_version = 1 })))
  end)

  it("passes a command it has no shape for unchanged", function()
    local payload = { anything = true }
    assert.are.equal(payload, messages.check(messages.to_host, "no_such_command", payload))
  end)
end)
