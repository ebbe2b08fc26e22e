-- wsync.runtime.engine_worker: the entry an engine's TP worker calls
-- (`worker_command` of the embedded host), through M.call as the vLLM
-- extension's direct loader calls it, on the host backend: the engine's
-- "parameters" are host memory of this test, one allocation per resident
-- tensor of TP rank 1 of 2's loader plan for the tiny Qwen3-MoE. The chunks
-- land in them, bound again only when they moved; parameters that do not
-- match the plan are refused; every failure comes out of the entry fatal.
local ffi = require("ffi")
local engine_worker = require("wsync.runtime.engine_worker")
local plan_module = require("wsync.plan")
local shm = require("wsync.native.shm")
local shm_transport = require("wsync.transport.shm")
local error_of = require("tests.helpers.errors").error_of

local BUFFER_BYTES, TP, RANK = 256 * 1024, 2, 1
local HEADER = { publication_id = string.rep("ab", 16), model_version = 3 }

local call = engine_worker.call

-- Deterministic bytes (a xorshift stream) over all of `buffer`.
local function fill_random(buffer, seed)
  local pointer = ffi.cast("uint8_t *", buffer:pointer())
  local state = seed
  for i = 0, buffer:size() - 1 do
    state = bit.bxor(state, bit.lshift(state, 13))
    state = bit.bxor(state, bit.rshift(state, 17))
    state = bit.bxor(state, bit.lshift(state, 5))
    pointer[i] = bit.band(state, 0xff)
  end
end

-- The tiny model's plan, this rank's loader plan, the packed buffers, and
-- `parameters()`: the engine's parameters allocated anew, by name, with the
-- `residents` the entry takes (name -> {pointer, size, dtype, shape}).
local function setup(quantization)
  local plan = plan_module.build({ family = "qwen3_moe", config = "tiny", quantization = quantization },
    { bytes = BUFFER_BYTES, count = 2 })
  local state = { plan = plan, opened = {} }
  state.loader_plan = plan_module.family("qwen3_moe").loader_plan(plan.config, TP, RANK, quantization)
  state.own = assert(shm_transport.create(2, BUFFER_BYTES))
  function state.parameters()
    local memories, residents = {}, {}
    for _, tensor in ipairs(state.loader_plan.tensors) do
      local memory = assert(shm.anonymous(tensor.bytes))
      state.opened[#state.opened + 1] = memory
      memories[tensor.name] = memory
      residents[tensor.name] = { pointer = tonumber(ffi.cast("uintptr_t", memory:pointer())), size = tensor.bytes,
        dtype = tensor.dtype, shape = tensor.shape, stride = tensor.stride }
    end
    return memories, residents
  end
  function state.close()
    call("close", {})
    for _, memory in ipairs(state.opened) do
      memory:close()
    end
    shm_transport.release(state.own)
  end
  return state
end

local function init_payload(state, residents, quantization, output_alignment)
  return { family = "qwen3_moe", config = "tiny", tp = TP, transport = "shm",
    buffers = shm_transport.descriptors(state.own), residents = residents, quantization = quantization,
    output_alignment = output_alignment }
end

-- Whether every row of every slice that chunk k fills on this rank holds,
-- in its parameter (`memories` by name), the bytes the packed buffer has.
local function landed(state, memories, k, slot)
  local buffer = state.own.buffers[slot]
  for _, tensor in ipairs(state.plan.chunks[k].tensors) do
    for _, slice in ipairs(state.loader_plan.copies[tensor.name] or {}) do
      local parameter = memories[slice.resident]
      local base = slice.dst - state.loader_plan.by_name[slice.resident].offset
      for row = 0, slice.rows - 1 do
        if buffer:read(tensor.offset + slice.src + row * slice.src_pitch, slice.width)
            ~= parameter:read(base + row * slice.dst_pitch, slice.width) then
          return false, string.format("%s, row %d", slice.resident, row)
        end
      end
    end
  end
  return true
end

-- One publication of every chunk through the entry, starting with
-- `start` (the start_update payload beyond the header); each chunk is
-- checked in `memories`. The receipt.
local function publish(state, memories, header, start, seed)
  local payload = { header = header }
  for key, value in pairs(start) do
    payload[key] = value
  end
  assert.are.same({}, call("start_update", payload))
  for k, chunk in ipairs(state.plan.chunks) do
    local slot = (k - 1) % 2 + 1
    fill_random(state.own.buffers[slot], seed + k)
    local result = call("load_chunk", { chunk = k, buffer = slot, tensors = chunk.tensors })
    assert.are.equal(#chunk.tensors, result.tensors)
    assert(landed(state, memories, k, slot))
  end
  return call("finish_update", { publication_id = header.publication_id, model_version = header.model_version })
end

describe("wsync.runtime.engine_worker", function()
  it("answers no command before it is opened, and none after it is closed", function()
    local err = error_of(call, "load_chunk", {})
    assert.are.same({ "NOT_INITIALIZED", "load_chunk before the worker was opened" }, { err.code, err.message })
    assert.is_true(err.fatal)
    call("open", { rank = 0, world = 1, backend = "host", device = 0 })
    assert.are.same({}, call("close", {}))
    assert.are.equal("NOT_INITIALIZED", error_of(call, "info", {}).code)
  end)

  it("loads the chunks into the engine's parameters and answers the receipt of what it loaded", function()
    local state = setup()
    local ok, message = pcall(function()
      local info = call("open", { rank = RANK, world = TP, backend = "host", device = 0 })
      assert.are.same({ RANK, TP, "host" }, { info.rank, info.world, info.device.backend })
      assert.are.same({ weights = "awake", kv_cache = "free" }, info.state)
      assert.are.same({ device_bytes = 0, host_bytes = 0 }, info.memory) -- (the engine's to say)
      local memories, residents = state.parameters()
      local result = call("init_weights", init_payload(state, residents))
      assert.are.same({ resident_tensors = #state.loader_plan.tensors, resident_bytes = state.loader_plan.bytes,
        buffers = 2, ordered = false }, result)
      local receipt = publish(state, memories, HEADER, { residents = residents }, 1)
      assert.are.same({ HEADER.publication_id, 3, RANK, TP, info.device.uuid, state.plan.manifest,
        #state.plan.canonical, #state.loader_plan.tensors }, { receipt.publication_id, receipt.model_version,
        receipt.tp_rank, receipt.tp_world, receipt.uuid, receipt.manifest, receipt.tensors,
        receipt.resident_tensors })
      -- The values check reads the parameters back, laid out as the plan lays them.
      local flat = assert(shm.anonymous(state.loader_plan.bytes))
      for _, tensor in ipairs(state.loader_plan.tensors) do
        flat:copy_from(memories[tensor.name], 0, tensor.offset, tensor.bytes)
      end
      local expected = require("wsync.plan.values").resident(state.loader_plan, flat)
      flat:close()
      assert.are.same({ rank = RANK, tensors = expected }, call("resident_values", {}))
    end)
    state.close()
    assert(ok, message)
  end)

  it("binds the parameters again only when told they moved, and loads where they lie now", function()
    local state = setup()
    local ok, message = pcall(function()
      call("open", { rank = RANK, world = TP, backend = "host", device = 0 })
      local memories, residents = state.parameters()
      call("init_weights", init_payload(state, residents))
      publish(state, memories, HEADER, { residents_unchanged = true }, 1)
      local moved
      moved, residents = state.parameters() -- (the engine slept and woke elsewhere)
      local receipt = publish(state, moved, { publication_id = string.rep("cd", 16), model_version = 4 },
        { residents = residents }, 2)
      assert.are.equal(4, receipt.model_version)
      publish(state, moved, { publication_id = string.rep("ef", 16), model_version = 5 },
        { residents_unchanged = true }, 3)
    end)
    state.close()
    assert(ok, message)
  end)

  it("refuses, fatally, parameters that do not match the loader plan", function()
    local state = setup()
    local ok, message = pcall(function()
      call("open", { rank = RANK, world = TP, backend = "host", device = 0 })
      local function refused(residents)
        local err = error_of(call, "init_weights", init_payload(state, residents))
        assert.are.equal("DIRECT_UNSUPPORTED", err.code)
        assert.is_true(err.fatal)
        return err.message
      end
      local _, residents = state.parameters()
      local name = state.loader_plan.tensors[1].name
      assert.matches("no resident parameters were given to the loader", refused(nil), 1, true)
      local parameter = residents[name]
      residents[name] = nil
      assert.matches("the engine has no parameter " .. name .. ", which the loader plan fills", refused(residents),
        1, true)
      residents[name] = { pointer = parameter.pointer, size = parameter.size, dtype = "float32",
        shape = parameter.shape }
      assert.matches("the engine's " .. name .. " is float32", refused(residents), 1, true)
      residents[name] = { pointer = parameter.pointer, size = parameter.size, dtype = parameter.dtype,
        shape = parameter.shape, stride = { 1, parameter.shape[1] } }
      assert.matches("the engine's " .. name .. " has strides [1," .. parameter.shape[1] .. "]; the loader plan "
        .. "writes it with strides [" .. parameter.shape[2] .. ",1] (row-major, contiguous)", refused(residents), 1,
        true)
      residents[name] = { pointer = parameter.pointer, size = parameter.size, dtype = "float32",
        shape = parameter.shape }
      assert.matches("the engine's " .. name .. " is float32", refused(residents), 1, true)
      residents[name] = parameter
      residents["model.extra.weight"] = parameter
      assert.matches("the engine's parameter model.extra.weight is not in the loader plan", refused(residents), 1,
        true)
      local err = error_of(call, "start_update", { header = HEADER, residents_unchanged = true })
      assert.are.same({ "DIRECT_UNSUPPORTED", "start_update says the engine's parameters are where they were bound, "
        .. "and none are bound" }, { err.code, err.message })
    end)
    state.close()
    assert(ok, message)
  end)

  it("under fp8 loads the engine's float8 weights and scales, and refuses an FP8 layout that is not vLLM's, named",
    function()
      local state = setup("fp8")
      local ok, message = pcall(function()
        call("open", { rank = RANK, world = TP, backend = "host", device = 0 })
        local function refused(residents, alignment) -- (alignment: 16 unless given; false: none)
          if alignment == nil then
            alignment = 16
          end
          local err = error_of(call, "init_weights", init_payload(state, residents, "fp8", alignment or nil))
          assert.are.equal("DIRECT_UNSUPPORTED", err.code)
          assert.is_true(err.fatal)
          return err.message
        end
        local p = "model.layers.1."
        local memories, residents = state.parameters()
        local qkv = residents[p .. "self_attn.qkv_proj.weight"]
        assert.are.same({ 1, qkv.shape[1] }, qkv.stride) -- (the [in, out] view, as vLLM holds it)
        -- A dense weight stored [in, out] contiguous, not as vLLM's view:
        residents[p .. "self_attn.qkv_proj.weight"] = { pointer = qkv.pointer, size = qkv.size, dtype = qkv.dtype,
          shape = qkv.shape, stride = { qkv.shape[2], 1 } }
        assert.matches("the engine's " .. p .. "self_attn.qkv_proj.weight has strides [" .. qkv.shape[2] .. ",1]; "
          .. "the loader plan writes it with strides [1," .. qkv.shape[1] .. "] (the [in, out] view of [out, in] "
          .. "row-major storage)", refused(residents), 1, true)
        residents[p .. "self_attn.qkv_proj.weight"] = qkv
        -- A scale vLLM does not hold (another quantization, or none):
        local scale = residents[p .. "mlp.experts.w13_weight_scale"]
        residents[p .. "mlp.experts.w13_weight_scale"] = nil
        assert.matches("the engine has no parameter " .. p .. "mlp.experts.w13_weight_scale, which the loader plan "
          .. "fills", refused(residents), 1, true)
        residents[p .. "mlp.experts.w13_weight_scale"] = scale
        -- A weight vLLM holds in bfloat16 (a layer it does not quantize):
        local router = residents[p .. "mlp.gate.weight"]
        residents[p .. "mlp.gate.weight"] = { pointer = router.pointer, size = router.size * 2, dtype = "bfloat16",
          shape = { router.shape[2], router.shape[1] } }
        assert.matches("the engine's " .. p .. "mlp.gate.weight is bfloat16", refused(residents), 1, true)
        -- The router as vLLM's CUTLASS kernel holds it when its experts are not a multiple
        -- of 16: [in, out] over [out padded to 16, in] storage, zeros after the plan's rows.
        -- It loads into the head of that storage; padding the input width is refused.
        local inputs, outputs = router.shape[1], router.shape[2]
        assert(outputs % 16 ~= 0, "the tiny config's router is not padded: the case below tests nothing")
        local rows = math.ceil(outputs / 16) * 16
        local padded = assert(shm.anonymous(inputs * rows))
        state.opened[#state.opened + 1] = padded
        residents[p .. "mlp.gate.weight"] = { pointer = tonumber(ffi.cast("uintptr_t", padded:pointer())),
          size = inputs * (rows + 16), dtype = router.dtype, shape = { inputs + 16, rows },
          stride = { 1, inputs + 16 } }
        assert.matches("the engine's " .. p .. "mlp.gate.weight is float8_e4m3fn [" .. (inputs + 16) .. "," .. rows
          .. "]", refused(residents), 1, true)
        residents[p .. "mlp.gate.weight"] = { pointer = tonumber(ffi.cast("uintptr_t", padded:pointer())),
          size = inputs * rows, dtype = router.dtype, shape = { inputs, rows }, stride = { 1, inputs } }
        memories[p .. "mlp.gate.weight"] = padded
        -- (Only where the engine says it pads, and to what.)
        assert.matches("the engine's " .. p .. "mlp.gate.weight is float8_e4m3fn [" .. inputs .. "," .. rows .. "]",
          refused(residents, false), 1, true)
        assert.matches("the engine's " .. p .. "mlp.gate.weight is float8_e4m3fn [" .. inputs .. "," .. rows .. "]",
          refused(residents, 32), 1, true)
        local err = error_of(call, "init_weights", init_payload(state, residents, "fp8", "16"))
        assert.are.same({ "DIRECT_UNSUPPORTED", "init_weights: output_alignment must be a positive integer, not 16" },
          { err.code, err.message })
        -- As vLLM holds them: the chunks load, the scales among what they fill.
        call("init_weights", init_payload(state, residents, "fp8", 16))
        call("start_update", { header = HEADER, residents_unchanged = true })
        for k, chunk in ipairs(state.plan.chunks) do
          local slot = (k - 1) % 2 + 1
          fill_random(state.own.buffers[slot], k)
          call("load_chunk", { chunk = k, buffer = slot, tensors = chunk.tensors })
        end
        local receipt = call("finish_update", HEADER)
        assert.are.equal(#state.loader_plan.tensors, receipt.resident_tensors)
        assert.are_not.equal(string.rep("\0", 4), memories[p .. "self_attn.qkv_proj.weight_scale"]:read(0, 4))
        assert.are_not.equal(string.rep("\0", inputs), padded:read(0, inputs))
        assert.are.equal(string.rep("\0", inputs * (rows - outputs)),
          padded:read(inputs * outputs, inputs * (rows - outputs)))
      end)
      state.close()
      assert(ok, message)
    end)

  it("has none of the reference worker's own commands, and turns a bug into a fatal WORKER_FAILED", function()
    local state = setup()
    local ok, message = pcall(function()
      call("open", { rank = RANK, world = TP, backend = "host", device = 0 })
      for _, cmd in ipairs({ "sleep", "wake", "checksum", "weights_digest", "resident_checksums" }) do
        local err = error_of(call, cmd, {})
        assert.are.same({ "UNKNOWN_COMMAND", "the embedded worker has no command '" .. cmd .. "'" },
          { err.code, err.message })
        assert.is_true(err.fatal)
      end
      local _, residents = state.parameters()
      call("init_weights", init_payload(state, residents))
      local err = error_of(call, "mapped", { buffer = 1 })
      assert.are.same({ "STATE_REFUSED", "the shm transport's buffers are not device regions" },
        { err.code, err.message })
      assert.is_true(err.fatal) -- (a refusal too: the entry's failures are fatal unless marked otherwise)
      assert.are.equal("mapped names buffer 3; 2 are mapped", error_of(call, "mapped", { buffer = 3 }).message)
      err = error_of(call, "init_weights", { family = "qwen3_moe", config = "tiny" })
      assert.are.equal("WORKER_FAILED", err.code)
      assert.is_true(err.fatal)
    end)
    state.close()
    assert(ok, message)
  end)
end)
