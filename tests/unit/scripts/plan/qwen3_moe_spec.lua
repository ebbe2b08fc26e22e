-- wsync.plan.qwen3_moe: the published configurations' counts, the trainer
-- layout and its canonical export views, the configurations the plan refuses,
-- FSDP dim-0 shards, and the TP loader plan, which is checked against a naive
-- element-by-element reference written here from shared/DESIGN.md section 6.
local qwen3_moe = require("wsync.plan.qwen3_moe")

local BF16 = 2

local error_of = require("tests.helpers.errors").error_of

local function numel(shape)
  local n = 1
  for _, size in ipairs(shape) do
    n = n * size
  end
  return n
end

local function with(base, changes)
  local config = {}
  for key, value in pairs(base) do
    config[key] = value
  end
  for key, value in pairs(changes or {}) do
    config[key] = value
  end
  return config
end

local TINY = qwen3_moe.presets.tiny

describe("qwen3_moe presets", function()
  local function enumerated(config)
    local parameters, bytes = 0, 0
    local canonical = qwen3_moe.canonical(config)
    for _, tensor in ipairs(canonical) do
      parameters = parameters + numel(tensor.shape)
      bytes = bytes + tensor.bytes
    end
    return { tensors = #canonical, parameters = parameters, bytes = bytes }
  end

  it("Qwen3-30B-A3B: 18867 tensors, 30532122624 parameters, 61064245248 bytes, by formula and by enumeration",
    function()
      local config = qwen3_moe.config("qwen3-30b-a3b")
      local expected = { tensors = 18867, parameters = 30532122624, bytes = 61064245248 }
      assert.are.same(expected, qwen3_moe.counts(config))
      assert.are.same(expected, enumerated(config))
    end)

  it("Qwen3-235B-A22B: 36945 tensors, 470187269120 bytes, by formula and by enumeration", function()
    local config = qwen3_moe.config("qwen3-235b-a22b")
    local counts = qwen3_moe.counts(config)
    assert.are.equal(36945, counts.tensors)
    assert.are.equal(470187269120, counts.bytes)
    assert.are.equal(470187269120 / 2, counts.parameters)
    assert.are.same(counts, enumerated(config))
  end)

  it("has tensors = L(3E+9)+3 for any untied config, L(3E+9)+2 when tied", function()
    for _, shape in ipairs({ { L = 1, E = 1 }, { L = 2, E = 4 }, { L = 3, E = 7 }, { L = 5, E = 16 } }) do
      local untied = qwen3_moe.config(with(TINY, { num_hidden_layers = shape.L, num_experts = shape.E }))
      local tied = qwen3_moe.config(with(untied, { tie_word_embeddings = true }))
      assert.are.equal(shape.L * (3 * shape.E + 9) + 3, qwen3_moe.counts(untied).tensors)
      assert.are.equal(shape.L * (3 * shape.E + 9) + 3, #qwen3_moe.canonical(untied))
      assert.are.equal(shape.L * (3 * shape.E + 9) + 2, qwen3_moe.counts(tied).tensors)
      assert.are.equal(shape.L * (3 * shape.E + 9) + 2, #qwen3_moe.canonical(tied))
      assert.are.same(qwen3_moe.counts(tied), enumerated(tied))
      assert.are.same(qwen3_moe.counts(untied), enumerated(untied))
    end
  end)

  it("drops lm_head, and only lm_head, when the embeddings are tied", function()
    local untied = qwen3_moe.canonical(qwen3_moe.config(TINY))
    local tied = qwen3_moe.canonical(qwen3_moe.config(with(TINY, { tie_word_embeddings = true })))
    assert.are.equal("lm_head.weight", untied[#untied].name)
    assert.are.same({ 1000, 64 }, untied[#untied].shape)
    assert.are.equal("model.norm.weight", tied[#tied].name)
    assert.are.equal(#untied - 1, #tied)
    for index = 1, #tied do
      assert.are.equal(untied[index].name, tied[index].name)
    end
    local counts_untied = qwen3_moe.counts(qwen3_moe.config(TINY))
    local counts_tied = qwen3_moe.counts(qwen3_moe.config(with(TINY, { tie_word_embeddings = true })))
    assert.are.equal(1000 * 64 * BF16, counts_untied.bytes - counts_tied.bytes)
  end)

  it("uses head_dim from the config, not hidden_size / heads", function()
    local config = qwen3_moe.config("qwen3-30b-a3b")
    local by_name = {}
    for _, tensor in ipairs(qwen3_moe.trainer_layout(config)) do
      by_name[tensor.name] = tensor
    end
    assert.are.same({ 32 * 128, 2048 }, by_name["model.layers.0.self_attn.q_proj.weight"].shape)
    assert.are.same({ 4 * 128, 2048 }, by_name["model.layers.0.self_attn.k_proj.weight"].shape)
    assert.are.same({ 2048, 32 * 128 }, by_name["model.layers.47.self_attn.o_proj.weight"].shape)
    assert.are.same({ 128 }, by_name["model.layers.0.self_attn.q_norm.weight"].shape)
    assert.are.same({ 128, 2 * 768, 2048 }, by_name["model.layers.0.mlp.experts.gate_up_proj"].shape)
    assert.are.same({ 128, 2048, 768 }, by_name["model.layers.0.mlp.experts.down_proj"].shape)
  end)
end)

describe("qwen3_moe.export", function()
  -- The views of one packed tensor must be back to back from offset 0, in
  -- expert order, and end exactly at the tensor's last byte.
  local function assert_tiles(views, total)
    local next_offset = 0
    for _, view in ipairs(views) do
      assert.are.equal(next_offset, view.offset, view.name)
      assert.are.equal(numel(view.shape) * BF16, view.bytes, view.name)
      next_offset = view.offset + view.bytes
    end
    assert.are.equal(total, next_offset)
  end

  it("views gate_up_proj [E, 2I, H] as gate then up of every expert", function()
    local E, I, H = 5, 6, 8
    local views = qwen3_moe.export("model.layers.3.mlp.experts.gate_up_proj", { E, 2 * I, H })
    assert.are.equal(2 * E, #views)
    assert_tiles(views, E * 2 * I * H * BF16)
    for e = 0, E - 1 do
      local gate, up = views[2 * e + 1], views[2 * e + 2]
      assert.are.equal("model.layers.3.mlp.experts." .. e .. ".gate_proj.weight", gate.name)
      assert.are.equal("model.layers.3.mlp.experts." .. e .. ".up_proj.weight", up.name)
      assert.are.same({ I, H }, gate.shape)
      assert.are.same({ I, H }, up.shape)
      -- gate_proj = gate_up_proj[e, :I], up_proj = gate_up_proj[e, I:]
      assert.are.equal((e * 2 * I * H) * BF16, gate.offset)
      assert.are.equal((e * 2 * I * H + I * H) * BF16, up.offset)
      assert.are.equal("bfloat16", gate.dtype)
    end
  end)

  it("views down_proj [E, H, I] as each expert's [H, I]", function()
    local E, H, I = 3, 8, 6
    local views = qwen3_moe.export("model.layers.0.mlp.experts.down_proj", { E, H, I })
    assert.are.equal(E, #views)
    assert_tiles(views, E * H * I * BF16)
    for e = 0, E - 1 do
      assert.are.equal("model.layers.0.mlp.experts." .. e .. ".down_proj.weight", views[e + 1].name)
      assert.are.same({ H, I }, views[e + 1].shape)
      assert.are.equal(e * H * I * BF16, views[e + 1].offset)
    end
  end)

  it("passes any other tensor through as itself at offset 0", function()
    local views = qwen3_moe.export("model.layers.1.self_attn.q_proj.weight", { 64, 32 })
    assert.are.same({ { name = "model.layers.1.self_attn.q_proj.weight", dtype = "bfloat16", shape = { 64, 32 },
      bytes = 64 * 32 * BF16, offset = 0 } }, views)
  end)

  it("exports what a wrongly shaped packed tensor really holds (one expert fewer)", function()
    local views = qwen3_moe.export("model.layers.0.mlp.experts.gate_up_proj", { 3, 64, 64 })
    assert.are.equal(6, #views)
    assert.are.equal("model.layers.0.mlp.experts.2.up_proj.weight", views[6].name)
  end)

  it("gives canonical() every view with its source tensor, covering the whole layout", function()
    local config = qwen3_moe.config(TINY)
    local layout = qwen3_moe.trainer_layout(config)
    local covered = {}
    for _, tensor in ipairs(qwen3_moe.canonical(config)) do
      local source = layout[tensor.source]
      covered[tensor.source] = (covered[tensor.source] or 0) + tensor.bytes
      assert.is_true(tensor.offset + tensor.bytes <= source.bytes, tensor.name)
    end
    for index, tensor in ipairs(layout) do
      assert.are.equal(tensor.bytes, covered[index], tensor.name)
    end
  end)
end)

describe("qwen3_moe.config", function()
  it("refuses an unknown preset, listing the known ones", function()
    local err = error_of(qwen3_moe.config, "qwen3-7b")
    assert.are.equal("MODEL_UNSUPPORTED", err.code)
    assert.are.equal("model", err.field)
    assert.matches("unknown Qwen3-MoE preset 'qwen3-7b' (presets: qwen3-235b-a22b, qwen3-30b-a3b, tiny)",
      err.message, 1, true)
  end)

  local refusals = {
    { change = { mlp_only_layers = { 1 } }, field = "mlp_only_layers", says = "dense MLP layers" },
    { change = { decoder_sparse_step = 2 }, field = "decoder_sparse_step", says = "decoder_sparse_step other than 1" },
    { change = { attention_bias = true }, field = "attention_bias", says = "attention_bias is not supported" },
    { change = { lora = { r = 8 } }, field = "lora", says = "LoRA adapters are not supported" },
    { change = { adapter_config = {} }, field = "lora", says = "LoRA adapters are not supported" },
    { change = { model_type = "qwen3" }, field = "model_type", says = "model_type qwen3 is not qwen3_moe" },
    { change = { num_experts = 0 }, field = "num_experts", says = "num_experts must be a positive integer, got 0" },
    { change = { head_dim = 2.5 }, field = "head_dim", says = "head_dim must be a positive integer" },
    { change = { hidden_size = "64" }, field = "hidden_size", says = "hidden_size must be a positive integer" },
  }
  for _, case in ipairs(refusals) do
    it("refuses " .. case.field .. " (" .. tostring(next(case.change)) .. ")", function()
      local err = error_of(qwen3_moe.config, with(TINY, case.change))
      assert.are.equal("MODEL_UNSUPPORTED", err.code)
      assert.are.equal(case.field, err.field)
      assert.matches(case.says, err.message, 1, true)
    end)
  end

  it("accepts the settings that change nothing: sparse step 1, no dense layers, no bias", function()
    local config = qwen3_moe.config(with(TINY, { decoder_sparse_step = 1, mlp_only_layers = {},
      attention_bias = false, model_type = "qwen3_moe" }))
    assert.are.equal(45, qwen3_moe.counts(config).tensors)
  end)

  it("does not change the preset it copies", function()
    local config = qwen3_moe.config("tiny")
    config.vocab_size = 7
    assert.are.equal(1000, qwen3_moe.presets.tiny.vocab_size)
  end)
end)

describe("qwen3_moe.check_tp", function()
  local function refusal(config, tp)
    local err = error_of(qwen3_moe.check_tp, qwen3_moe.config(config), tp)
    assert.are.equal("MODEL_UNSUPPORTED", err.code)
    assert.are.equal("tp", err.field)
    return err.message
  end

  it("refuses a TP size that does not divide the heads, the expert width or the padded vocabulary", function()
    assert.are.equal("TP 3 does not divide num_attention_heads (4)", refusal(TINY, 3))
    assert.are.equal("TP 4 does not divide moe_intermediate_size (30)",
      refusal(with(TINY, { moe_intermediate_size = 30 }), 4))
    assert.are.equal("TP 3 does not divide the padded vocabulary (1024)",
      refusal(with(TINY, { num_attention_heads = 6, num_key_value_heads = 3, moe_intermediate_size = 36 }), 3))
  end)

  it("refuses KV heads that neither divide nor are divided by the TP size", function()
    assert.are.equal("TP 4 and num_key_value_heads 6: neither divides the other",
      refusal(with(TINY, { num_attention_heads = 12, num_key_value_heads = 6 }), 4))
    assert.are.equal("TP 2 and num_key_value_heads 3: neither divides the other",
      refusal(with(TINY, { num_attention_heads = 6, num_key_value_heads = 3 }), 2))
  end)

  it("refuses TP 0 and accepts KV heads replicated (t > nkv) or split (t < nkv)", function()
    assert.matches("at least 1", refusal(TINY, 0), 1, true)
    qwen3_moe.check_tp(qwen3_moe.config(TINY), 4)
    qwen3_moe.check_tp(qwen3_moe.config(with(TINY, { num_key_value_heads = 4 })), 2)
    qwen3_moe.check_tp(qwen3_moe.config("qwen3-30b-a3b"), 8)
  end)
end)

describe("qwen3_moe.shard_rows", function()
  it("splits as torch.chunk: ceil(rows / world) rows per rank, the last ones short or empty", function()
    local function split(rows, world)
      local out = {}
      for rank = 0, world - 1 do
        local first, count = qwen3_moe.shard_rows(rows, world, rank)
        out[#out + 1] = { first, count }
      end
      return out
    end
    assert.are.same({ { 0, 3 }, { 3, 3 }, { 6, 3 }, { 9, 1 } }, split(10, 4))
    assert.are.same({ { 0, 2 }, { 2, 2 }, { 4, 1 }, { 5, 0 } }, split(5, 4))
    assert.are.same({ { 0, 1 }, { 1, 0 }, { 1, 0 }, { 1, 0 } }, split(1, 4))
    assert.are.same({ { 0, 3 }, { 3, 3 }, { 6, 1 } }, split(7, 3))
    assert.are.same({ { 0, 2 }, { 2, 2 }, { 4, 0 } }, split(4, 3))
  end)

  it("covers every row exactly once, in rank order, for every size and world", function()
    for world = 1, 9 do
      for rows = 1, 40 do
        local next_row, chunk = 0, math.ceil(rows / world)
        for rank = 0, world - 1 do
          local first, count = qwen3_moe.shard_rows(rows, world, rank)
          assert.is_true(count >= 0 and count <= chunk)
          if count > 0 then
            assert.are.equal(next_row, first, string.format("rows %d world %d rank %d", rows, world, rank))
            next_row = first + count
          end
        end
        assert.are.equal(rows, next_row)
      end
    end
  end)
end)

-- The loader plan against a naive reference ---------------------------------

-- Canonical values: element i of the canonical tensor with stream index id is
-- id * 2^20 + i (distinct everywhere, exact in a double).
local function value_of(id, index)
  return id * 1048576 + index
end

-- The resident tensors of TP rank r, built element by element from full
-- canonical tensors following shared/DESIGN.md section 6's table. Returns
-- {{name, shape, values (0-based flat table; nil = zero padding)}} in vLLM's
-- parameter order.
local function reference_resident(config, tp, r)
  local V, H, I = config.vocab_size, config.hidden_size, config.moe_intermediate_size
  local nh, nkv, hd, E = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.num_experts
  local ids = {}
  for id, tensor in ipairs(qwen3_moe.canonical(config)) do
    ids[tensor.name] = id
  end
  -- canonical[name][row][column] of a 2-D tensor, or [i] of a 1-D one
  local function canonical2(name, columns)
    local id = assert(ids[name], name)
    return function(row, column)
      return value_of(id, row * columns + column)
    end
  end
  local out = {}
  local function resident(name, shape, element)
    local values = {}
    if #shape == 1 then
      for i = 0, shape[1] - 1 do
        values[i] = element(i)
      end
    elseif #shape == 2 then
      for i = 0, shape[1] - 1 do
        for j = 0, shape[2] - 1 do
          values[i * shape[2] + j] = element(i, j)
        end
      end
    else
      for e = 0, shape[1] - 1 do
        for i = 0, shape[2] - 1 do
          for j = 0, shape[3] - 1 do
            values[(e * shape[2] + i) * shape[3] + j] = element(e, i, j)
          end
        end
      end
    end
    out[#out + 1] = { name = name, shape = shape, values = values }
  end
  local function replicated(name, shape)
    if #shape == 1 then
      local id = assert(ids[name], name)
      resident(name, shape, function(i)
        return value_of(id, i)
      end)
    else
      local source = canonical2(name, shape[2])
      resident(name, shape, source)
    end
  end
  local Vp = math.ceil(V / 64) * 64
  local function vocab_parallel(name)
    local rows = Vp / tp
    local source = canonical2(name, H)
    resident(name, { rows, H }, function(i, j)
      local row = r * rows + i
      if row < V then
        return source(row, j)
      end
      return nil -- padding rows beyond the vocabulary hold zeros
    end)
  end

  local q_rows = nh / tp * hd
  local heads = {} -- the KV heads of rank r
  if tp <= nkv then
    for h = r * (nkv / tp), (r + 1) * (nkv / tp) - 1 do
      heads[#heads + 1] = h
    end
  else
    heads[1] = math.floor(r / (tp / nkv)) -- replicated over tp / nkv ranks
  end
  local kv_rows = #heads * hd
  local I_local = I / tp

  vocab_parallel("model.embed_tokens.weight")
  for l = 0, config.num_hidden_layers - 1 do
    local p = "model.layers." .. l .. "."
    local q = canonical2(p .. "self_attn.q_proj.weight", H)
    local k = canonical2(p .. "self_attn.k_proj.weight", H)
    local v = canonical2(p .. "self_attn.v_proj.weight", H)
    resident(p .. "self_attn.qkv_proj.weight", { q_rows + 2 * kv_rows, H }, function(i, j)
      if i < q_rows then
        return q(r * q_rows + i, j)
      end
      local kv_i = (i - q_rows) % kv_rows
      local head, within = heads[math.floor(kv_i / hd) + 1], kv_i % hd
      local source = i < q_rows + kv_rows and k or v
      return source(head * hd + within, j)
    end)
    local columns = nh * hd / tp
    local o = canonical2(p .. "self_attn.o_proj.weight", nh * hd)
    resident(p .. "self_attn.o_proj.weight", { H, columns }, function(i, j)
      return o(i, r * columns + j)
    end)
    replicated(p .. "self_attn.q_norm.weight", { hd })
    replicated(p .. "self_attn.k_norm.weight", { hd })
    replicated(p .. "mlp.gate.weight", { E, H })
    resident(p .. "mlp.experts.w13_weight", { E, 2 * I_local, H }, function(e, i, j)
      local expert = p .. "mlp.experts." .. e .. "."
      if i < I_local then
        return canonical2(expert .. "gate_proj.weight", H)(r * I_local + i, j)
      end
      return canonical2(expert .. "up_proj.weight", H)(r * I_local + i - I_local, j)
    end)
    resident(p .. "mlp.experts.w2_weight", { E, H, I_local }, function(e, i, j)
      return canonical2(p .. "mlp.experts." .. e .. ".down_proj.weight", I)(i, r * I_local + j)
    end)
    replicated(p .. "input_layernorm.weight", { H })
    replicated(p .. "post_attention_layernorm.weight", { H })
  end
  replicated("model.norm.weight", { H })
  if not config.tie_word_embeddings then
    vocab_parallel("lm_head.weight")
  end
  return out
end

-- Executes the plan's copy lists on the same canonical values, in elements.
-- Returns the resident storage (0-based flat table) and how often each
-- element was written.
local function execute_plan(config, plan)
  local storage, writes = {}, {}
  local canonical = qwen3_moe.canonical(config)
  for id, tensor in ipairs(canonical) do
    for _, copy in ipairs(plan.copies[tensor.name] or {}) do
      for _, bytes in ipairs({ copy.dst, copy.src, copy.width, copy.dst_pitch, copy.src_pitch }) do
        assert.are.equal(0, bytes % BF16, "a copy splits an element of " .. tensor.name)
      end
      local span = copy.src + (copy.rows - 1) * copy.src_pitch + copy.width
      assert.is_true(span <= tensor.bytes, tensor.name .. ": a copy reads past the tensor")
      for row = 0, copy.rows - 1 do
        local dst = (copy.dst + row * copy.dst_pitch) / BF16
        local src = (copy.src + row * copy.src_pitch) / BF16
        for element = 0, copy.width / BF16 - 1 do
          storage[dst + element] = value_of(id, src + element)
          writes[dst + element] = (writes[dst + element] or 0) + 1
        end
      end
    end
  end
  return storage, writes
end

local LOADER_CASES = {
  { label = "tiny, TP1", config = TINY, tp = 1 },
  { label = "tiny, TP2 (one KV head per rank)", config = TINY, tp = 2 },
  { label = "tiny, TP4 (nkv 2: each KV head replicated on two ranks)", config = TINY, tp = 4 },
  { label = "nkv 4, TP2 (two KV heads per rank), tied, vocabulary a multiple of 64", tp = 2,
    config = { vocab_size = 128, hidden_size = 16, moe_intermediate_size = 8, num_hidden_layers = 1,
      num_attention_heads = 8, num_key_value_heads = 4, head_dim = 4, num_experts = 3,
      tie_word_embeddings = true } },
  { label = "nkv 1, TP4 (one KV head on every rank), odd vocabulary", tp = 4,
    config = { vocab_size = 201, hidden_size = 8, moe_intermediate_size = 4, num_hidden_layers = 2,
      num_attention_heads = 4, num_key_value_heads = 1, head_dim = 6, num_experts = 2 } },
}

describe("qwen3_moe.loader_plan", function()
  for _, case in ipairs(LOADER_CASES) do
    it("matches the element-by-element reference: " .. case.label, function()
      local config = qwen3_moe.config(case.config)
      for rank = 0, case.tp - 1 do
        local plan = qwen3_moe.loader_plan(config, case.tp, rank)
        local reference = reference_resident(config, case.tp, rank)
        -- The same resident tensors, shapes and order, back to back.
        assert.are.equal(#reference, #plan.tensors)
        local offset = 0
        for index, expected in ipairs(reference) do
          local tensor = plan.tensors[index]
          assert.are.equal(expected.name, tensor.name)
          assert.are.same(expected.shape, tensor.shape, tensor.name)
          assert.are.equal(offset, tensor.offset, tensor.name)
          assert.are.equal(numel(tensor.shape) * BF16, tensor.bytes)
          assert.are.equal(tensor, plan.by_name[tensor.name])
          offset = offset + tensor.bytes
        end
        assert.are.equal(offset, plan.bytes)
        -- Every copy names a canonical tensor and lands in the resident
        -- tensor it says, and the storage equals the reference everywhere.
        local canonical_names = {}
        for _, tensor in ipairs(qwen3_moe.canonical(config)) do
          canonical_names[tensor.name] = true
          assert.is_not_nil(plan.copies[tensor.name], "rank " .. rank .. " loads nothing of " .. tensor.name)
        end
        for name, copies in pairs(plan.copies) do
          assert.is_true(canonical_names[name], name .. " is not a canonical tensor")
          for _, copy in ipairs(copies) do
            local into = plan.by_name[copy.resident]
            local last = copy.dst + (copy.rows - 1) * copy.dst_pitch + copy.width
            assert.is_true(copy.dst >= into.offset and last <= into.offset + into.bytes, name)
          end
        end
        local storage, writes = execute_plan(config, plan)
        for _, expected in ipairs(reference) do
          local base = plan.by_name[expected.name].offset / BF16
          for element = 0, numel(expected.shape) - 1 do
            local want = expected.values[element]
            if want ~= storage[base + element] then
              error(string.format("rank %d of TP%d, %s element %d: the plan puts %s, the reference %s", rank,
                case.tp, expected.name, element, tostring(storage[base + element]), tostring(want)))
            end
            -- Written once, or never where the reference holds padding.
            assert.are.equal(want ~= nil and 1 or nil, writes[base + element])
          end
        end
      end
    end)
  end

  it("sizes the resident storage of the 30B model's TP4 rank as vLLM does", function()
    local config = qwen3_moe.config("qwen3-30b-a3b")
    local plan = qwen3_moe.loader_plan(config, 4, 3)
    local V, H, I, E, L = 151936, 2048, 768, 128, 48
    local per_layer = (32 / 4 * 128 + 2 * 128) * H + H * (32 * 128 / 4) + 2 * 128 + E * H
      + E * (2 * I / 4) * H + E * H * (I / 4) + 2 * H
    assert.are.equal(((V / 4) * H * 2 + L * per_layer + H) * BF16, plan.bytes)
    assert.are.equal(2 + L * 9 + 1, #plan.tensors)
  end)

  it("refuses a TP size the model does not divide", function()
    local err = error_of(qwen3_moe.loader_plan, qwen3_moe.config(TINY), 3, 0)
    assert.are.equal("MODEL_UNSUPPORTED", err.code)
  end)
end)

-- Executes the plan's copy lists on the canonical values, by byte offset in
-- the resident storage: a quantized copy (`group`) writes one byte an
-- element, and each element keeps its group. Returns the values, the groups
-- and how often each was written, and how many copies name each group.
local function execute_bytes(config, plan)
  local storage, groups, writes, slices = {}, {}, {}, {}
  for id, tensor in ipairs(qwen3_moe.canonical(config)) do
    for _, copy in ipairs(plan.copies[tensor.name] or {}) do
      local target_element = copy.group and 1 or BF16
      if copy.group then
        slices[copy.group] = (slices[copy.group] or 0) + 1
      end
      for row = 0, copy.rows - 1 do
        for element = 0, copy.width / BF16 - 1 do
          local dst = copy.dst + row * copy.dst_pitch + element * target_element
          storage[dst] = value_of(id, (copy.src + row * copy.src_pitch) / BF16 + element)
          groups[dst] = copy.group
          writes[dst] = (writes[dst] or 0) + 1
        end
      end
    end
  end
  return storage, groups, writes, slices
end

describe("qwen3_moe.loader_plan under fp8", function()
  local DENSE = { "self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate.weight" }
  local EXPERTS = { "mlp.experts.w13_weight", "mlp.experts.w2_weight" }
  local function kind_of(name)
    for _, suffix in ipairs(DENSE) do
      if name:sub(-#suffix) == suffix then
        return "dense"
      end
    end
    for _, suffix in ipairs(EXPERTS) do
      if name:sub(-#suffix) == suffix then
        return "experts"
      end
    end
  end

  for _, case in ipairs(LOADER_CASES) do
    it("puts every linear weight's elements where the bfloat16 reference does, one byte each, under one scale per "
      .. "layer or expert: " .. case.label, function()
      local config = qwen3_moe.config(case.config)
      for rank = 0, case.tp - 1 do
        local plan = qwen3_moe.loader_plan(config, case.tp, rank, "fp8")
        local storage, groups, writes, slices = execute_bytes(config, plan)
        local index, offset = 0, 0
        for _, expected in ipairs(reference_resident(config, case.tp, rank)) do
          index = index + 1
          local tensor, kind = plan.tensors[index], kind_of(expected.name)
          assert.are.equal(expected.name, tensor.name)
          assert.are.equal(offset, tensor.offset, tensor.name)
          local count = numel(expected.shape)
          local scale
          if kind then
            assert.are.equal("float8_e4m3fn", tensor.dtype, tensor.name)
            assert.are.equal(count, tensor.bytes)
            if kind == "dense" then
              -- (vLLM's [in, out] transposed view of [out, in] storage)
              assert.are.same({ expected.shape[2], expected.shape[1] }, tensor.shape)
              assert.are.same({ 1, expected.shape[2] }, tensor.stride)
            else
              assert.are.same(expected.shape, tensor.shape)
              assert.is_nil(tensor.stride)
            end
            index = index + 1
            scale = plan.tensors[index]
            local experts = kind == "experts" and expected.shape[1] or 1
            assert.are.same({ name = kind == "dense" and tensor.name:gsub("%.weight$", ".weight_scale")
              or tensor.name .. "_scale", dtype = "float32", shape = { experts }, bytes = 4 * experts,
              offset = tensor.offset + tensor.bytes }, scale)
          else
            assert.are.equal("bfloat16", tensor.dtype, tensor.name)
          end
          local element_bytes = kind and 1 or BF16
          for element = 0, count - 1 do
            local at = tensor.offset + element * element_bytes
            local want = expected.values[element]
            if want ~= storage[at] then
              error(string.format("rank %d of TP%d, %s element %d: the plan puts %s, the reference %s", rank,
                case.tp, expected.name, element, tostring(storage[at]), tostring(want)))
            end
            assert.are.equal(want ~= nil and 1 or nil, writes[at])
            if kind then
              local expert = kind == "experts" and math.floor(element / (count / expected.shape[1])) or 0
              local group = plan.groups[groups[at]]
              assert.are.equal(scale.name, group.scale)
              assert.are.equal(scale.offset + 4 * expert, group.scale_dst, tensor.name)
            else
              assert.is_nil(groups[at])
            end
          end
          offset = tensor.offset + tensor.bytes + (scale and scale.bytes or 0)
        end
        assert.are.equal(#plan.tensors, index)
        assert.are.equal(offset, plan.bytes)
        -- One group per layer's dense weight and per expert of each fused
        -- tensor, each counting the slices that name it.
        local E, L = config.num_experts, config.num_hidden_layers
        assert.are.equal(L * (3 + 2 * E), #plan.groups)
        for g, group in ipairs(plan.groups) do
          assert.are.equal(slices[g], group.slices, group.name)
        end
      end
    end)
  end

  it("names each group's parameter and the canonical tensors under its scale", function()
    local plan = qwen3_moe.loader_plan(qwen3_moe.config(TINY), 2, 1, "fp8")
    local p = "model.layers.1."
    local by_name = {}
    for _, group in ipairs(plan.groups) do
      by_name[group.name] = group
    end
    assert.are.same({ p .. "self_attn.q_proj.weight", p .. "self_attn.k_proj.weight", p .. "self_attn.v_proj.weight" },
      by_name[p .. "self_attn.qkv_proj.weight"].tensors)
    assert.are.equal(3, by_name[p .. "self_attn.qkv_proj.weight"].slices)
    assert.are.same({ p .. "mlp.experts.3.gate_proj.weight", p .. "mlp.experts.3.up_proj.weight" },
      by_name[p .. "mlp.experts.w13_weight[3]"].tensors)
    assert.are.same({ p .. "mlp.experts.2.down_proj.weight" }, by_name[p .. "mlp.experts.w2_weight[2]"].tensors)
    assert.are.equal(p .. "mlp.experts.w2_weight_scale", by_name[p .. "mlp.experts.w2_weight[2]"].scale)
    assert.are.same({ p .. "mlp.gate.weight" }, by_name[p .. "mlp.gate.weight"].tensors)
  end)

  it("starts every float32 scale on a 4-byte boundary, whatever the float8 sizes before it", function()
    local config = qwen3_moe.config({ vocab_size = 64, hidden_size = 5, moe_intermediate_size = 3,
      num_hidden_layers = 1, num_attention_heads = 1, num_key_value_heads = 1, head_dim = 3, num_experts = 3 })
    local plan = qwen3_moe.loader_plan(config, 1, 0, "fp8")
    local misaligned, reach = 0, 0
    for _, tensor in ipairs(plan.tensors) do
      assert.is_true(tensor.offset >= reach, tensor.name) -- (no overlap; padding at most)
      reach = tensor.offset + tensor.bytes
      if tensor.dtype == "float32" then
        assert.are.equal(0, tensor.offset % 4, tensor.name)
      elseif reach % 4 ~= 0 then
        misaligned = misaligned + 1
      end
    end
    assert.is_true(misaligned > 0) -- (the sizes would misalign them back to back)
    assert.are.equal(reach, plan.bytes)
  end)

  it("has no groups and no quantized slices without a quantization", function()
    local plan = qwen3_moe.loader_plan(qwen3_moe.config(TINY), 2, 0)
    assert.are.same({}, plan.groups)
    for _, copies in pairs(plan.copies) do
      for _, copy in ipairs(copies) do
        assert.is_nil(copy.group)
      end
    end
  end)
end)

describe("qwen3_moe.rollout_residents", function()
  it("is the loader plan's bfloat16 tensors without a quantization", function()
    local config = qwen3_moe.config("tiny")
    local plan = qwen3_moe.loader_plan(config, 2, 1)
    local residents = qwen3_moe.rollout_residents(config, 2, 1)
    assert.are.same(plan.tensors, residents.tensors)
    assert.are.equal(plan.bytes, residents.bytes)
  end)

  it("holds vLLM's online per-tensor FP8: linear weights in float8 transposed, a float32 scale per layer or expert",
    function()
      local config = qwen3_moe.config("tiny")
      local E, H = config.num_experts, config.hidden_size
      for rank = 0, 1 do
        local bf16 = qwen3_moe.loader_plan(config, 2, rank)
        local fp8 = qwen3_moe.rollout_residents(config, 2, rank, "fp8")
        local by_name = {}
        for _, tensor in ipairs(fp8.tensors) do
          by_name[tensor.name] = tensor
        end
        local total = 0
        for _, tensor in ipairs(fp8.tensors) do
          total = total + tensor.bytes
        end
        assert.are.equal(total, fp8.bytes)
        local p = "model.layers.0."
        local qkv = bf16.by_name[p .. "self_attn.qkv_proj.weight"]
        assert.are.same({ name = p .. "self_attn.qkv_proj.weight", dtype = "float8_e4m3fn",
          shape = { qkv.shape[2], qkv.shape[1] }, bytes = qkv.bytes / 2 }, by_name[p .. "self_attn.qkv_proj.weight"])
        assert.are.same({ name = p .. "self_attn.qkv_proj.weight_scale", dtype = "float32", shape = { 1 }, bytes = 4 },
          by_name[p .. "self_attn.qkv_proj.weight_scale"])
        assert.are.equal("float8_e4m3fn", by_name[p .. "mlp.gate.weight"].dtype) -- (the router is linear too)
        assert.are.same({ H, E }, by_name[p .. "mlp.gate.weight"].shape)
        local w13 = bf16.by_name[p .. "mlp.experts.w13_weight"]
        assert.are.same({ name = p .. "mlp.experts.w13_weight", dtype = "float8_e4m3fn", shape = w13.shape,
          bytes = w13.bytes / 2 }, by_name[p .. "mlp.experts.w13_weight"])
        assert.are.same({ name = p .. "mlp.experts.w13_weight_scale", dtype = "float32", shape = { E },
          bytes = 4 * E }, by_name[p .. "mlp.experts.w13_weight_scale"])
        assert.are.same({ E }, by_name[p .. "mlp.experts.w2_weight_scale"].shape)
        for _, name in ipairs({ "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
          p .. "input_layernorm.weight", p .. "self_attn.q_norm.weight" }) do
          assert.are.equal("bfloat16", by_name[name].dtype, name)
          assert.are.equal(bf16.by_name[name].bytes, by_name[name].bytes, name)
        end
        -- (Every bfloat16 resident is in the FP8 list, and each layer has five
        -- scales: qkv, o_proj, the router, w13, w2.)
        assert.are.equal(#bf16.tensors + 5 * config.num_hidden_layers, #fp8.tensors)
      end
    end)

  it("refuses a quantization it does not plan, naming it", function()
    local err = error_of(qwen3_moe.rollout_residents, qwen3_moe.config("tiny"), 1, 0, "awq")
    assert.are.equal("MODEL_UNSUPPORTED", err.code)
    assert.are.equal("quantization", err.field)
    assert.matches("quantization awq: wsync plans bfloat16 rollouts and \"fp8\"", err.message, 1, true)
  end)
end)
