-- wsync.plan: chunks of trainer tensors' rows packed back to back up to the
-- buffer size (a tensor goes on in the next chunk only where no canonical
-- tensor goes on), the canonical tensors each chunk carries and their
-- offsets, the expected manifest, and the summary `wsync check` prints.
local manifest = require("wsync.native.manifest")
local plan_module = require("wsync.plan")
local qwen3_moe = require("wsync.plan.qwen3_moe")

local KiB = 1024

local error_of = require("tests.helpers.errors").error_of

local function tiny(changes)
  local config = {}
  for key, value in pairs(qwen3_moe.presets.tiny) do
    config[key] = value
  end
  for key, value in pairs(changes or {}) do
    config[key] = value
  end
  return config
end

local function build(config, bytes, count)
  return plan_module.build({ family = "qwen3_moe", config = config or "tiny" }, { bytes = bytes, count = count or 2 })
end

-- The tiny model's trainer tensors: the embedding and lm_head (128000 bytes
-- each) are the largest; the packed experts are 32768 and 16384 bytes.
local LARGEST = 1000 * 64 * 2

describe("plan.build chunks", function()
  -- The rows a chunk may end at inside a trainer tensor: where none of its
  -- canonical tensors goes on.
  local function cut_allowed(tensor, row)
    local row_bytes = tensor.bytes / tensor.shape[1]
    for _, record in ipairs(qwen3_moe.export(tensor.name, tensor.shape)) do
      if record.offset < row * row_bytes and row * row_bytes < record.offset + record.bytes then
        return false
      end
    end
    return true
  end

  for _, bytes in ipairs({ LARGEST, 160 * KiB, 200 * KiB, 1024 * KiB }) do
    it("packs trainer tensors' rows back to back in layout order, full chunks, none over " .. bytes .. " bytes",
      function()
        local plan = build("tiny", bytes)
        local layout = qwen3_moe.trainer_layout(qwen3_moe.config("tiny"))
        local index, next_row = 1, 0
        for k, chunk in ipairs(plan.chunks) do
          assert.are.equal(k, chunk.index)
          local offset = 0
          for _, slot in ipairs(chunk.slots) do
            if next_row == layout[index].shape[1] then
              index, next_row = index + 1, 0
            end
            local tensor = layout[index]
            -- the trainer tensor's next rows, where the previous slot ended
            assert.are.equal(index, slot.index)
            assert.are.equal(tensor.name, slot.name)
            assert.are.same({ next_row, slot.rows[2] }, slot.rows)
            assert.are.equal(tensor.bytes / tensor.shape[1] * slot.rows[2], slot.bytes)
            assert.are.same(tensor.shape, slot.shape)
            assert.are.equal(offset, slot.offset)
            offset = offset + slot.bytes
            next_row = next_row + slot.rows[2]
            assert.is_true(next_row == tensor.shape[1] or cut_allowed(tensor, next_row),
              string.format("%s cut at row %d, inside a canonical tensor", tensor.name, next_row))
          end
          assert.are.equal(offset, chunk.bytes)
          assert.is_true(chunk.bytes <= bytes, "chunk " .. k .. " holds " .. chunk.bytes)
        end
        assert.are.equal(#layout, index)
        assert.are.equal(layout[index].shape[1], next_row)
        assert.are.equal(qwen3_moe.counts(qwen3_moe.config("tiny")).bytes, plan.bytes)
      end)
  end

  it("goes on with a packed expert tensor in the next chunk at an expert's boundary", function()
    -- (the 30B's 1 GiB chunks: 58, where whole trainer tensors took 97)
    local plan = build("tiny", LARGEST)
    local pieces = {}
    for k, chunk in ipairs(plan.chunks) do
      for _, slot in ipairs(chunk.slots) do
        if slot.name == "model.layers.1.mlp.experts.gate_up_proj" then
          pieces[#pieces + 1] = { k, slot.rows[1], slot.rows[2] }
        end
      end
    end
    assert.are.same({ { 2, 0, 3 }, { 3, 3, 1 } }, pieces)
    assert.are.equal(4, #plan.chunks) -- the embedding, two of layers, lm_head
    local gigabyte = plan_module.build({ family = "qwen3_moe", config = "qwen3-30b-a3b" }, { bytes = 1024 ^ 3,
      count = 2 })
    assert.are.equal(58, #gigabyte.chunks)
  end)

  it("makes one chunk when the buffer holds the whole model", function()
    local plan = build("tiny", 405248)
    assert.are.equal(1, #plan.chunks)
    assert.are.equal(405248, plan.chunks[1].bytes)
  end)

  it("starts a chunk only when the next piece does not fit, with a buffer of just the largest", function()
    local plan = build("tiny", LARGEST)
    for k = 1, #plan.chunks - 1 do
      local chunk, following = plan.chunks[k], plan.chunks[k + 1]
      local first = following.slots[1]
      -- the next chunk's first piece: its first slot, up to its first allowed cut
      local layout = qwen3_moe.trainer_layout(qwen3_moe.config("tiny"))
      local tensor = layout[first.index]
      local row, row_bytes = first.rows[1] + 1, tensor.bytes / tensor.shape[1]
      while row < tensor.shape[1] and not cut_allowed(tensor, row) do
        row = row + 1
      end
      assert.is_true(chunk.bytes + (row - first.rows[1]) * row_bytes > LARGEST, "chunk " .. k .. " had room")
    end
    assert.are.equal("model.embed_tokens.weight", plan.chunks[1].slots[1].name)
    assert.are.equal(1, #plan.chunks[1].slots)
  end)

  it("under fp8 keeps each layer's q, k and v in one chunk (one scale), which bfloat16 does not need", function()
    -- The chunk of every canonical tensor under a plan, and how many layers'
    -- q, k and v went to more than one chunk.
    local function split_layers(plan)
      local chunk_of = {}
      for _, chunk in ipairs(plan.chunks) do
        for _, tensor in ipairs(chunk.tensors) do
          chunk_of[tensor.name] = chunk.index
        end
      end
      local split = 0
      for l = 0, qwen3_moe.presets.tiny.num_hidden_layers - 1 do
        local p = "model.layers." .. l .. ".self_attn."
        local q = chunk_of[p .. "q_proj.weight"]
        if chunk_of[p .. "k_proj.weight"] ~= q or chunk_of[p .. "v_proj.weight"] ~= q then
          split = split + 1
        end
        -- (and an expert's gate and up, one row of gate_up_proj, never part)
        for e = 0, qwen3_moe.presets.tiny.num_experts - 1 do
          local expert = "model.layers." .. l .. ".mlp.experts." .. e .. "."
          assert.are.equal(chunk_of[expert .. "gate_proj.weight"], chunk_of[expert .. "up_proj.weight"])
        end
      end
      return split
    end
    local bf16_split, chunks = 0, {}
    for bytes = LARGEST, LARGEST + 64 * KiB, 512 do
      bf16_split = bf16_split + split_layers(build("tiny", bytes))
      local plan = plan_module.build({ family = "qwen3_moe", config = "tiny", quantization = "fp8" },
        { bytes = bytes, count = 2 })
      assert.are.equal("fp8", plan.quantization)
      assert.are.equal(0, split_layers(plan), "buffer of " .. bytes .. " bytes")
      assert.are.equal(build("tiny", bytes).manifest, plan.manifest)
      chunks[#plan.chunks] = true
    end
    assert.is_true(bf16_split > 0) -- (the sizes tried do split them without a quantization)
    assert.is_true(next(chunks, next(chunks)) ~= nil) -- (and make chunks of several counts)
  end)

  it("refuses under fp8 a buffer that cannot hold a layer's q, k and v together, naming them", function()
    -- A small vocabulary: q_proj (8192 bytes) and an expert (8192) are the largest pieces; q, k and v 16384.
    local config = tiny({ vocab_size = 64 })
    assert.is_table(build(config, 16383))
    local err = error_of(plan_module.build, { family = "qwen3_moe", config = config, quantization = "fp8" },
      { bytes = 16383, count = 2 })
    assert.are.equal("PLAN_INVALID", err.code)
    assert.are.equal("buffers.bytes", err.field)
    assert.are.equal("model.layers.0.self_attn.q_proj.weight", err.tensor)
    assert.matches("tensors model.layers.0.self_attn.q_proj.weight to model.layers.0.self_attn.v_proj.weight share "
      .. "one fp8 scale and come in one chunk: 16384 bytes (16.00 KiB); the buffer holds 16383", err.message, 1, true)
  end)

  it("refuses a trainer tensor larger than the buffer, naming it and both byte counts", function()
    local err = error_of(build, "tiny", LARGEST - 1)
    assert.are.equal("PLAN_INVALID", err.code)
    assert.are.equal("buffers.bytes", err.field)
    assert.are.equal("model.embed_tokens.weight", err.tensor)
    assert.matches("model.embed_tokens.weight", err.message, 1, true)
    assert.matches("needs 128000 bytes", err.message, 1, true)
    assert.matches("holds 127999", err.message, 1, true)
  end)

  it("names the first piece that does not fit, one expert of a packed tensor included", function()
    -- tied, a small vocabulary and wide experts: one expert of gate_up_proj [4, 128, 64] is the largest piece
    local err = error_of(build, tiny({ vocab_size = 64, tie_word_embeddings = true, moe_intermediate_size = 64 }),
      16383)
    assert.are.equal("PLAN_INVALID", err.code)
    assert.are.equal("model.layers.0.mlp.experts.gate_up_proj", err.tensor)
    assert.matches("needs 16384 bytes (16.00 KiB) in one piece (rows 0 to 0 of 4)", err.message, 1, true)
    assert.matches("holds 16383", err.message, 1, true)
  end)

  it("refuses a config size no number holds exactly, naming it as written", function()
    local err = error_of(build, tiny({ vocab_size = 1e308 }), 1024 * KiB)
    assert.are.equal("MODEL_UNSUPPORTED", err.code)
    assert.are.equal("vocab_size", err.field)
    assert.are.equal("config field vocab_size must be at most 2^53 (9007199254740992), got 1e+308", err.message)
  end)

  it("refuses a config of more tensors than a plan holds before enumerating them", function()
    local started = os.clock()
    local err = error_of(build, tiny({ num_hidden_layers = 65536 }), 1024 * KiB)
    assert.is_true(os.clock() - started < 0.1)
    assert.are.equal("num_hidden_layers", err.field)
    assert.are.equal("the config makes 1376259 canonical tensors (65536 layers x 21 per layer); a plan holds at most "
      .. "1048576", err.message)
    assert.matches("^the config makes 21000000003 canonical tensors %(1000000000 layers x 21 per layer%)",
      error_of(build, tiny({ num_hidden_layers = 1e9 }), 1024 * KiB).message)
    err = error_of(build, tiny({ num_experts = 2 ^ 30 }), 1024 * KiB)
    assert.are.equal("num_experts", err.field)
  end)

  it("refuses a config of more bytes than a number holds exactly", function()
    local err = error_of(build, tiny({ hidden_size = 2 ^ 40, vocab_size = 2 ^ 20 }), 1024 * KiB)
    assert.are.equal("model", err.field)
    assert.matches("^the config makes [%d.e+]+ bytes of weights; a plan holds at most 2%^53 %(9007199254740992%)$",
      err.message)
  end)

  it("refuses an unknown model family, listing the known ones", function()
    local err = error_of(plan_module.build, { family = "llama", config = "tiny" }, { bytes = 1, count = 1 })
    assert.are.equal("MODEL_UNSUPPORTED", err.code)
    assert.matches("unknown model family 'llama' (known: qwen3_moe)", err.message, 1, true)
  end)
end)

describe("plan.build canonical tensors", function()
  it("places every canonical tensor inside its trainer tensor's slot, in stream order", function()
    local plan = build("tiny", LARGEST) -- (a packed expert tensor in two chunks)
    local config = qwen3_moe.config("tiny")
    local canonical = qwen3_moe.canonical(config)
    local layout = qwen3_moe.trainer_layout(config)
    assert.are.equal(#canonical, #plan.canonical)
    local stream = 0
    for _, chunk in ipairs(plan.chunks) do
      local slots = {}
      for _, slot in ipairs(chunk.slots) do
        slots[slot.name] = slot
      end
      local covered = 0
      for _, tensor in ipairs(chunk.tensors) do
        stream = stream + 1
        local expected = canonical[stream]
        assert.are.equal(plan.canonical[stream], tensor)
        assert.are.equal(expected.name, tensor.name)
        assert.are.same(expected.shape, tensor.shape)
        assert.are.equal(expected.bytes, tensor.bytes)
        assert.are.equal(layout[expected.source].name, tensor.source)
        local slot = assert(slots[tensor.source], tensor.name .. " outside its chunk's slots")
        local row_bytes = slot.bytes / slot.rows[2]
        assert.are.equal(expected.offset, tensor.source_offset)
        assert.are.equal(slot.offset + expected.offset - slot.rows[1] * row_bytes, tensor.offset)
        assert.is_true(tensor.offset + tensor.bytes <= slot.offset + slot.bytes)
        covered = covered + tensor.bytes
      end
      assert.are.equal(chunk.bytes, covered) -- the views tile the chunk
    end
    assert.are.equal(#canonical, stream)
  end)

  it("offsets an expert's up_proj I*H elements after its gate_proj, inside the packed slot", function()
    local plan = build("tiny", 160 * KiB)
    for _, chunk in ipairs(plan.chunks) do
      local by_name = {}
      for _, tensor in ipairs(chunk.tensors) do
        by_name[tensor.name] = tensor
      end
      local gate = by_name["model.layers.1.mlp.experts.3.gate_proj.weight"]
      if gate then
        local up = by_name["model.layers.1.mlp.experts.3.up_proj.weight"]
        assert.are.equal(gate.offset + 32 * 64 * 2, up.offset)
        assert.are.equal(3 * 64 * 64 * 2, gate.source_offset)
      end
    end
  end)
end)

describe("plan.build manifest", function()
  it("is wsync.native.manifest.of the canonical stream, computed from the config alone", function()
    local plan = build("tiny", 160 * KiB)
    assert.are.equal(manifest.of(qwen3_moe.canonical(qwen3_moe.config("tiny"))).digest, plan.manifest)
    assert.are.equal(manifest.of(plan.canonical).digest, plan.manifest)
    assert.matches("^%x+$", plan.manifest)
    assert.are.equal(64, #plan.manifest)
  end)

  it("does not depend on the buffers", function()
    assert.are.equal(build("tiny", 160 * KiB).manifest, build("tiny", 1024 * KiB, 1).manifest)
  end)

  it("changes with the config", function()
    local base = build(tiny(), 1024 * KiB).manifest
    assert.are.equal(base, build("tiny", 1024 * KiB).manifest)
    local seen = { [base] = "tiny" }
    for label, changes in pairs({
      experts = { num_experts = 5 },
      tied = { tie_word_embeddings = true },
      vocab = { vocab_size = 999 },
      head_dim = { head_dim = 8 },
      layers = { num_hidden_layers = 3 },
      kv = { num_key_value_heads = 4 },
    }) do
      local digest = build(tiny(changes), 1024 * KiB).manifest
      assert.is_nil(seen[digest], label .. " gives the manifest of " .. tostring(seen[digest]))
      seen[digest] = label
    end
  end)
end)

describe("plan.summary", function()
  it("has the fields `wsync check` shows", function()
    local plan = build("tiny", 160 * KiB)
    assert.are.same({
      family = "qwen3_moe",
      tensors = 45,
      trainer_tensors = 25,
      bytes = 405248,
      chunks = 3,
      buffer_bytes = 160 * KiB,
      buffers = 2,
      largest_tensor = "model.embed_tokens.weight",
      largest_tensor_bytes = LARGEST,
      manifest = plan.manifest,
    }, plan_module.summary(plan))
  end)

  it("gives the 30B model's counts", function()
    local plan = plan_module.build({ family = "qwen3_moe", config = "qwen3-30b-a3b" }, { bytes = 1024 ^ 3, count = 2 })
    local summary = plan_module.summary(plan)
    assert.are.equal(18867, summary.tensors)
    assert.are.equal(48 * 11 + 3, summary.trainer_tensors)
    assert.are.equal(61064245248, summary.bytes)
    assert.are.equal("model.layers.0.mlp.experts.gate_up_proj", summary.largest_tensor)
    assert.are.equal(128 * 2 * 768 * 2048 * 2, summary.largest_tensor_bytes)
    for _, chunk in ipairs(plan.chunks) do
      assert.is_true(chunk.bytes <= 1024 ^ 3)
    end
  end)
end)

describe("plan.format_bytes", function()
  it("writes bytes with binary units", function()
    assert.are.equal("1023 B", plan_module.format_bytes(1023))
    assert.are.equal("160.00 KiB", plan_module.format_bytes(160 * KiB))
    assert.are.equal("1.50 GiB", plan_module.format_bytes(1.5 * 1024 ^ 3))
  end)
end)
