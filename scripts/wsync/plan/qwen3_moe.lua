--- Qwen3-MoE: the trainer layout, the canonical export stream, the expected
--- manifest and the TP loader plan, all from the model config alone.
---
--- Trainer layout (transformers v5, FSDP shards every tensor on dim 0): the
--- checkpoint's names except the experts, which are packed per layer as
--- `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first) and
--- `mlp.experts.down_proj` [E, H, I].
---
--- Canonical stream (Hugging Face checkpoint names, [out, in]): the trainer
--- tensors in layout order, each packed tensor expanded into per-expert names:
--- for every expert e of a layer, `experts.{e}.gate_proj.weight` =
--- gate_up_proj[e, :I] and `experts.{e}.up_proj.weight` = gate_up_proj[e, I:],
--- then for every e `experts.{e}.down_proj.weight` = down_proj[e]. Every
--- canonical tensor is a contiguous range of its trainer tensor, so once that
--- tensor is gathered into a buffer slot its canonical tensors are views of the
--- slot: no copy. Per-expert names are always emitted (vLLM ignores packed
--- expert names on an in-place update).
---
--- TP loader plan (vLLM's layout, TP size t, rank r): vocab-parallel
--- embed_tokens/lm_head rows of Vp/t (Vp = V rounded up to 64); fused qkv_proj
--- (q rows of rank r, then its k and v head slice, replicated when t > nkv);
--- o_proj columns; experts.w13_weight [E, 2I/t, H] (gate slice then up slice);
--- experts.w2_weight [E, H, I/t] (column slice); norms and the router
--- replicated.
local errors = require("wsync.errors")

local M = {}

local DTYPE = "bfloat16"
local ELEMENT_BYTES = 2

--- Published configurations, and a tiny one for tests and the demo.
M.presets = {
  ["qwen3-30b-a3b"] = {
    vocab_size = 151936, hidden_size = 2048, moe_intermediate_size = 768, num_hidden_layers = 48,
    num_attention_heads = 32, num_key_value_heads = 4, head_dim = 128, num_experts = 128,
    tie_word_embeddings = false, decoder_sparse_step = 1, mlp_only_layers = {},
  },
  ["qwen3-235b-a22b"] = {
    vocab_size = 151936, hidden_size = 4096, moe_intermediate_size = 1536, num_hidden_layers = 94,
    num_attention_heads = 64, num_key_value_heads = 4, head_dim = 128, num_experts = 128,
    tie_word_embeddings = false, decoder_sparse_step = 1, mlp_only_layers = {},
  },
  tiny = {
    vocab_size = 1000, hidden_size = 64, moe_intermediate_size = 32, num_hidden_layers = 2,
    num_attention_heads = 4, num_key_value_heads = 2, head_dim = 16, num_experts = 4,
    tie_word_embeddings = false, decoder_sparse_step = 1, mlp_only_layers = {},
  },
}

local REQUIRED = {
  "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
  "num_key_value_heads", "head_dim", "num_experts",
}

--- The config fields that fix the plan's shapes: two configs that agree on
--- these (and on tie_word_embeddings) make the same tensors.
M.SHAPE_FIELDS = REQUIRED

--- The most canonical tensors a plan may have: the plan, every loader plan
--- and the manifest hold a record per tensor in memory (the 235B preset has
--- 36,945).
M.MAX_TENSORS = 2 ^ 20
--- The largest size or byte count a config may make: larger integers are not
--- exact in a Lua number.
M.MAX_INTEGER = 2 ^ 53

local function unsupported(message, field)
  errors.raise("MODEL_UNSUPPORTED", message, { field = field })
end

--- Validates a config (a preset name or a table of config.json values) and
--- returns the normalized table. Rejects what the plan does not support:
--- dense (mlp_only) layers or a sparse step other than 1, LoRA adapters,
--- attention bias, and a missing or non-positive size.
---@param spec string|table
---@return table
function M.config(spec)
  if type(spec) == "string" then
    local preset = M.presets[spec]
    if not preset then
      local names = {}
      for name in pairs(M.presets) do
        names[#names + 1] = name
      end
      table.sort(names)
      unsupported(string.format("unknown Qwen3-MoE preset '%s' (presets: %s)", spec, table.concat(names, ", ")),
        "model")
    end
    spec = preset
  end
  local config = {}
  for key, value in pairs(spec) do
    config[key] = value
  end
  for _, key in ipairs(REQUIRED) do
    local value = config[key]
    if type(value) ~= "number" or value < 1 or value ~= math.floor(value) then
      unsupported(string.format("config field %s must be a positive integer, got %s", key, tostring(value)), key)
    end
    if value > M.MAX_INTEGER then
      unsupported(string.format("config field %s must be at most 2^53 (9007199254740992), got %s", key,
        tostring(value)), key)
    end
  end
  if config.model_type ~= nil and config.model_type ~= "qwen3_moe" then
    unsupported(string.format("model_type %s is not qwen3_moe", tostring(config.model_type)), "model_type")
  end
  if (config.decoder_sparse_step or 1) ~= 1 then
    unsupported("decoder_sparse_step other than 1 makes dense layers, an unknown layer kind for this plan",
      "decoder_sparse_step")
  end
  if config.mlp_only_layers and #config.mlp_only_layers > 0 then
    unsupported("mlp_only_layers (dense MLP layers) are an unknown layer kind for this plan", "mlp_only_layers")
  end
  if config.attention_bias then
    unsupported("attention_bias is not supported by this plan", "attention_bias")
  end
  if config.lora or config.adapter_config then
    unsupported("LoRA adapters are not supported: publish merged weights", "lora")
  end
  config.tie_word_embeddings = config.tie_word_embeddings == true
  config.decoder_sparse_step, config.mlp_only_layers = 1, {}
  -- Before anything is enumerated: a config of a billion layers is refused
  -- here, not after minutes of building its plan.
  local counts = M.counts(config)
  if counts.tensors > M.MAX_TENSORS then
    local per_layer = 3 * config.num_experts + 9
    unsupported(string.format("the config makes %.0f canonical tensors (%s layers x %s per layer); a plan holds at "
      .. "most %d", counts.tensors, tostring(config.num_hidden_layers), tostring(per_layer), M.MAX_TENSORS),
      config.num_hidden_layers >= per_layer and "num_hidden_layers" or "num_experts")
  end
  if counts.bytes > M.MAX_INTEGER then
    unsupported(string.format("the config makes %s bytes of weights; a plan holds at most 2^53 (9007199254740992)",
      tostring(counts.bytes)), "model")
  end
  return config
end

local function numel(shape)
  local count = 1
  for _, size in ipairs(shape) do
    count = count * size
  end
  return count
end

--- The trainer's tensors in layout order: `{name, dtype, shape, bytes}`.
---@param config table  from M.config
---@return table[]
function M.trainer_layout(config)
  local V, H, I = config.vocab_size, config.hidden_size, config.moe_intermediate_size
  local nh, nkv, hd, E = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.num_experts
  local tensors = {}
  local function add(name, shape)
    tensors[#tensors + 1] = { name = name, dtype = DTYPE, shape = shape, bytes = numel(shape) * ELEMENT_BYTES }
  end
  add("model.embed_tokens.weight", { V, H })
  for l = 0, config.num_hidden_layers - 1 do
    local p = "model.layers." .. l .. "."
    add(p .. "self_attn.q_proj.weight", { nh * hd, H })
    add(p .. "self_attn.k_proj.weight", { nkv * hd, H })
    add(p .. "self_attn.v_proj.weight", { nkv * hd, H })
    add(p .. "self_attn.o_proj.weight", { H, nh * hd })
    add(p .. "self_attn.q_norm.weight", { hd })
    add(p .. "self_attn.k_norm.weight", { hd })
    add(p .. "mlp.gate.weight", { E, H })
    add(p .. "mlp.experts.gate_up_proj", { E, 2 * I, H })
    add(p .. "mlp.experts.down_proj", { E, H, I })
    add(p .. "input_layernorm.weight", { H })
    add(p .. "post_attention_layernorm.weight", { H })
  end
  add("model.norm.weight", { H })
  if not config.tie_word_embeddings then
    add("lm_head.weight", { V, H })
  end
  return tensors
end

--- The canonical tensors one trainer tensor exports, in stream order:
--- `{name, dtype, shape, bytes, offset}` with `offset` in bytes from the start
--- of the trainer tensor. `shape` is the trainer tensor's (registered) shape,
--- so that an exporter given a wrong shape exports what it really holds.
---@param name string
---@param shape integer[]
---@return table[]
function M.export(name, shape)
  local prefix = name:match("^(model%.layers%.%d+%.mlp%.experts%.)gate_up_proj$")
  if prefix then
    local E, two_I, H = shape[1], shape[2], shape[3]
    local I = two_I / 2
    local out = {}
    for e = 0, E - 1 do
      local base = e * two_I * H * ELEMENT_BYTES
      local bytes = I * H * ELEMENT_BYTES
      out[#out + 1] = { name = prefix .. e .. ".gate_proj.weight", dtype = DTYPE, shape = { I, H }, bytes = bytes,
        offset = base }
      out[#out + 1] = { name = prefix .. e .. ".up_proj.weight", dtype = DTYPE, shape = { I, H }, bytes = bytes,
        offset = base + bytes }
    end
    return out
  end
  prefix = name:match("^(model%.layers%.%d+%.mlp%.experts%.)down_proj$")
  if prefix then
    local E, H, I = shape[1], shape[2], shape[3]
    local out = {}
    for e = 0, E - 1 do
      local bytes = H * I * ELEMENT_BYTES
      out[#out + 1] = { name = prefix .. e .. ".down_proj.weight", dtype = DTYPE, shape = { H, I }, bytes = bytes,
        offset = e * bytes }
    end
    return out
  end
  return { { name = name, dtype = DTYPE, shape = shape, bytes = numel(shape) * ELEMENT_BYTES, offset = 0 } }
end

--- Every canonical tensor in stream order, each with `source` (its trainer
--- tensor's index in the layout) and `offset` within that tensor.
---@param config table
---@return table[]
function M.canonical(config)
  local out = {}
  for index, tensor in ipairs(M.trainer_layout(config)) do
    for _, canonical in ipairs(M.export(tensor.name, tensor.shape)) do
      canonical.source = index
      out[#out + 1] = canonical
    end
  end
  return out
end

--- The runs of trainer tensors (`layout`, M.trainer_layout's) that a chunk
--- must carry whole under `quantization`: `{[first index] = last index}`.
--- Under "fp8" a layer's q_proj, k_proj and v_proj are one: the rank-local
--- fused qkv has one scale over all three, so the loader quantizes them in
--- one load (an expert's gate and up lie in one row of gate_up_proj, which a
--- chunk never splits).
---@param layout table[]
---@param quantization string?
---@return table<integer, integer>
function M.coupled(layout, quantization)
  local runs = {}
  if quantization == "fp8" then
    for index, tensor in ipairs(layout) do
      if tensor.name:match("%.self_attn%.q_proj%.weight$") then
        runs[index] = index + 2
      end
    end
  end
  return runs
end

--- Counts from the config: tensors, parameters and BF16 bytes of the
--- canonical checkpoint, by the closed-form formulas (no enumeration).
---@param config table
function M.counts(config)
  local V, H, I, L = config.vocab_size, config.hidden_size, config.moe_intermediate_size, config.num_hidden_layers
  local nh, nkv, hd, E = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.num_experts
  local embeddings = config.tie_word_embeddings and 1 or 2
  local tensors = L * (3 * E + 9) + 1 + embeddings
  local per_layer = 2 * H * hd * (nh + nkv) + 2 * H + 2 * hd + E * H + 3 * E * I * H
  local parameters = embeddings * V * H + H + L * per_layer
  return { tensors = tensors, parameters = parameters, bytes = parameters * ELEMENT_BYTES }
end

--- TP checks: raises MODEL_UNSUPPORTED naming what does not divide.
---@param config table
---@param tp integer
function M.check_tp(config, tp)
  local function require_divides(what, value)
    if value % tp ~= 0 then
      unsupported(string.format("TP %d does not divide %s (%d)", tp, what, value), "tp")
    end
  end
  if tp < 1 then
    unsupported("TP size must be at least 1", "tp")
  end
  require_divides("num_attention_heads", config.num_attention_heads)
  require_divides("moe_intermediate_size", config.moe_intermediate_size)
  require_divides("the padded vocabulary", M.padded_vocab(config))
  local nkv = config.num_key_value_heads
  if nkv % tp ~= 0 and tp % nkv ~= 0 then
    unsupported(string.format("TP %d and num_key_value_heads %d: neither divides the other", tp, nkv), "tp")
  end
end

--- Vocabulary rounded up to a multiple of 64, as vLLM pads it.
function M.padded_vocab(config)
  return math.ceil(config.vocab_size / 64) * 64
end

--- Refuses a quantization the plans do not hold (nil: bfloat16 residents;
--- "fp8": vLLM's online per-tensor FP8 of a bfloat16 checkpoint).
---@param quantization string?
function M.check_quantization(quantization)
  if quantization ~= nil and quantization ~= "fp8" then
    unsupported(string.format("quantization %s: wsync plans bfloat16 rollouts and \"fp8\" (vLLM's online "
      .. "per-tensor FP8 of a bfloat16 checkpoint)", tostring(quantization)), "quantization")
  end
end

--- The resident tensors of TP rank `rank` of `tp` and how each canonical
--- tensor lands in them. Returns `{tensors = {{name, dtype, shape, bytes,
--- offset, stride?}}, bytes = total, copies = {[canonical name] = {{resident,
--- dst, src, rows, width, dst_pitch, src_pitch, group?}}}, groups}`: `rows`
--- copies of `width` bytes from `src` (bytes from the canonical tensor's
--- start, advancing `src_pitch` per row) to `dst` (bytes from the resident
--- storage's start, advancing `dst_pitch`).
---
--- Under `quantization` "fp8" (vLLM's online per-tensor FP8, read in
--- bindings/python/wsync/vllm/FP8.md, sections 2 and 3) every linear layer's
--- weight is float8_e4m3fn with float32 scales beside it, and a slice with a
--- `group` is quantized while it is copied: its `width` and `src_pitch`
--- count bfloat16 source bytes, its `dst` and `dst_pitch` float8 bytes (one
--- an element). `groups[g]` = `{name, scale, scale_dst, slices, tensors}`:
--- the parameter (and expert) whose one scale, the float32 at byte
--- `scale_dst` of resident `scale`, covers every element of its `slices`
--- slices, those of the canonical `tensors`; a load must quantize them
--- together (H4 of FP8.md: the rank-local fused q, k and v of a layer under
--- one scale, an expert's gate and up under one). The dense weights
--- (qkv_proj, o_proj, the router mlp.gate) are stored [out, in] row-major and
--- seen by the kernels as their transpose: their `shape` is the kernels'
--- [in, out], `stride` {1, in}.
---@param config table
---@param tp integer
---@param rank integer
---@param quantization string?
function M.loader_plan(config, tp, rank, quantization)
  M.check_tp(config, tp)
  M.check_quantization(quantization)
  local fp8 = quantization == "fp8"
  local V, H, I = config.vocab_size, config.hidden_size, config.moe_intermediate_size
  local nh, nkv, hd, E = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.num_experts
  local B = ELEMENT_BYTES
  local plan = { tensors = {}, copies = {}, bytes = 0, groups = {}, quantization = quantization }
  local by_name = {}
  local function resident(name, shape, dtype, element_bytes, stride)
    -- (A float32 scale starts on a 4-byte boundary of one memory in the
    -- plan's layout: a device writes it as a float.)
    local offset = element_bytes == 4 and math.ceil(plan.bytes / 4) * 4 or plan.bytes
    plan.bytes = offset
    local tensor = { name = name, dtype = dtype or DTYPE, shape = shape, bytes = numel(shape) * (element_bytes or B),
      offset = offset, stride = stride }
    plan.tensors[#plan.tensors + 1] = tensor
    plan.bytes = plan.bytes + tensor.bytes
    by_name[name] = tensor
    return tensor
  end
  -- A linear layer's weight of `rows` x `columns` ([out, in]) and, under
  -- fp8, its scales (one, or one per expert of `experts` x rows x columns).
  local function linear(name, rows, columns, experts)
    if not fp8 then
      return resident(name, experts and { experts, rows, columns } or { rows, columns })
    end
    local weight
    if experts then
      weight = resident(name, { experts, rows, columns }, "float8_e4m3fn", 1)
      weight.scales = resident(name .. "_scale", { experts }, "float32", 4)
    else
      weight = resident(name, { columns, rows }, "float8_e4m3fn", 1, { 1, columns })
      weight.scales = resident(name:gsub("%.weight$", "") .. ".weight_scale", { 1 }, "float32", 4)
    end
    return weight
  end
  -- The group of the scale `index` (0-based) of `weight`.
  local function group(weight, index, label)
    local g = { name = label or weight.name, scale = weight.scales.name, scale_dst = weight.scales.offset + 4 * index,
      slices = 0, tensors = {} }
    plan.groups[#plan.groups + 1] = g
    return #plan.groups
  end
  local function copy(canonical, tensor, dst, src, rows, width, dst_pitch, src_pitch, g)
    local list = plan.copies[canonical]
    if not list then
      list = {}
      plan.copies[canonical] = list
    end
    local element = g and 2 or 1 -- (source bytes per target byte)
    list[#list + 1] = {
      resident = tensor.name, dst = tensor.offset + dst, src = src, rows = rows, width = width,
      dst_pitch = dst_pitch or width / element, src_pitch = src_pitch or width, group = g,
    }
    if g then
      local members = plan.groups[g]
      members.slices = members.slices + 1
      if members.tensors[#members.tensors] ~= canonical then
        members.tensors[#members.tensors + 1] = canonical
      end
    end
  end
  local function replicated(canonical, shape)
    local tensor = resident(canonical, shape)
    copy(canonical, tensor, 0, 0, 1, tensor.bytes)
  end
  -- Rows [src_row, + rows) of a canonical tensor of `row_elements` columns
  -- into rows from `dst_row` of `tensor` (quantized in group `g`).
  local function contiguous_rows(canonical, tensor, dst_row, src_row, rows, row_elements, g)
    if rows > 0 then
      local target_element = g and 1 or B
      copy(canonical, tensor, dst_row * row_elements * target_element, src_row * row_elements * B, 1,
        rows * row_elements * B, nil, nil, g)
    end
  end

  local Vp = M.padded_vocab(config)
  local vocab_rows = Vp / tp
  local vocab_first = rank * vocab_rows
  local vocab_real = math.max(0, math.min(vocab_rows, V - vocab_first)) -- the rest is zero padding
  local function vocab_parallel(canonical)
    local tensor = resident(canonical, { vocab_rows, H })
    contiguous_rows(canonical, tensor, 0, vocab_first, vocab_real, H)
  end

  local q_rows = nh / tp * hd
  local kv_heads = nkv >= tp and nkv / tp or 1
  local kv_head_first = nkv >= tp and rank * kv_heads or math.floor(rank / (tp / nkv))
  local kv_rows = kv_heads * hd
  local I_local = I / tp

  vocab_parallel("model.embed_tokens.weight")
  for l = 0, config.num_hidden_layers - 1 do
    local p = "model.layers." .. l .. "."
    local qkv = linear(p .. "self_attn.qkv_proj.weight", q_rows + 2 * kv_rows, H)
    local qkv_group = fp8 and group(qkv, 0) or nil
    contiguous_rows(p .. "self_attn.q_proj.weight", qkv, 0, rank * q_rows, q_rows, H, qkv_group)
    contiguous_rows(p .. "self_attn.k_proj.weight", qkv, q_rows, kv_head_first * hd, kv_rows, H, qkv_group)
    contiguous_rows(p .. "self_attn.v_proj.weight", qkv, q_rows + kv_rows, kv_head_first * hd, kv_rows, H, qkv_group)
    local columns = nh * hd / tp
    local o_proj = linear(p .. "self_attn.o_proj.weight", H, columns)
    copy(p .. "self_attn.o_proj.weight", o_proj, 0, rank * columns * B, H, columns * B, fp8 and columns or columns * B,
      nh * hd * B, fp8 and group(o_proj, 0) or nil)
    replicated(p .. "self_attn.q_norm.weight", { hd })
    replicated(p .. "self_attn.k_norm.weight", { hd })
    local router = linear(p .. "mlp.gate.weight", E, H)
    copy(p .. "mlp.gate.weight", router, 0, 0, 1, E * H * B, nil, nil, fp8 and group(router, 0) or nil)
    local w13 = linear(p .. "mlp.experts.w13_weight", 2 * I_local, H, E)
    local w2 = linear(p .. "mlp.experts.w2_weight", H, I_local, E)
    local w2_element = fp8 and 1 or B
    for e = 0, E - 1 do
      local expert = p .. "mlp.experts." .. e .. "."
      local w13_expert = e * 2 * I_local
      local w13_group = fp8 and group(w13, e, string.format("%s[%d]", w13.name, e)) or nil
      contiguous_rows(expert .. "gate_proj.weight", w13, w13_expert, rank * I_local, I_local, H, w13_group)
      contiguous_rows(expert .. "up_proj.weight", w13, w13_expert + I_local, rank * I_local, I_local, H, w13_group)
      copy(expert .. "down_proj.weight", w2, e * H * I_local * w2_element, rank * I_local * B, H, I_local * B,
        I_local * w2_element, I * B, fp8 and group(w2, e, string.format("%s[%d]", w2.name, e)) or nil)
    end
    replicated(p .. "input_layernorm.weight", { H })
    replicated(p .. "post_attention_layernorm.weight", { H })
  end
  replicated("model.norm.weight", { H })
  if not config.tie_word_embeddings then
    vocab_parallel("lm_head.weight")
  end
  plan.by_name = by_name
  return plan
end

--- What vLLM 0.26 holds of TP rank `rank` of `tp` under `quantization`
--- (nil: the bfloat16 resident tensors of M.loader_plan; "fp8": its online
--- per-tensor FP8 of a bfloat16 checkpoint, read from vLLM's sources in
--- bindings/python/wsync/vllm/FP8.md: the residents of M.loader_plan under
--- "fp8"). Under "fp8" every linear layer holds its weight in
--- float8_e4m3fn, stored [out, in] row-major and seen by the kernels as its
--- transpose [in, out], with one float32 `weight_scale` for the whole layer
--- (the fused qkv under one); the router (`mlp.gate`) is linear too; each
--- fused expert tensor holds one float32 scale per expert
--- (`w13_weight_scale`: gate and up under one). Embeddings, lm_head and the
--- norms stay bfloat16. Returns `{tensors = {{name, dtype, shape, bytes}},
--- bytes}` (shapes as the kernels see them).
---@param config table
---@param tp integer
---@param rank integer
---@param quantization string?
function M.rollout_residents(config, tp, rank, quantization)
  local plan = M.loader_plan(config, tp, rank, quantization)
  if quantization == nil then
    return { tensors = plan.tensors, bytes = plan.bytes }
  end
  local out = { tensors = {}, bytes = 0 }
  for index, tensor in ipairs(plan.tensors) do
    out.tensors[index] = { name = tensor.name, dtype = tensor.dtype, shape = tensor.shape, bytes = tensor.bytes }
    out.bytes = out.bytes + tensor.bytes
  end
  return out
end

--- FSDP dim-0 sharding as torch.chunk does it: rank q holds rows
--- [q*c, min((q+1)*c, rows)) with c = ceil(rows / world); late ranks may hold
--- none. Returns first row and row count.
---@param rows integer
---@param world integer
---@param rank integer
---@return integer first, integer count
function M.shard_rows(rows, world, rank)
  local chunk = math.ceil(rows / world)
  local first = math.min(rank * chunk, rows)
  return first, math.min(chunk, rows - first)
end

return M
