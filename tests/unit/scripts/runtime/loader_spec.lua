-- wsync.runtime.loader: the weight loader through its commands, against a
-- memory of the test's own (a wsync.ResidentMemory: one host region in the
-- loader plan's layout, recording what the loader asks of it) on the shm
-- transport: the tiny Qwen3-MoE's chunks land where TP rank 1 of 2's loader
-- plan puts them, the receipt names what was loaded, commands out of order
-- are refused. Its runtime failures are coded errors marked fatal (the main
-- process then reports the worker and the host destroys the runtime), never
-- bare assertion errors.
local ffi = require("ffi")
local errors = require("wsync.errors")
local loader_module = require("wsync.runtime.loader")
local manifest_module = require("wsync.native.manifest")
local plan_module = require("wsync.plan")
local shm = require("wsync.native.shm")
local shm_transport = require("wsync.transport.shm")
local error_of = require("tests.helpers.errors").error_of

local BUFFER_BYTES, TP, RANK = 256 * 1024, 2, 1
local HEADER = { publication_id = string.rep("ab", 16), model_version = 3 }

-- A memory of the test's own: one host region of the plan's bytes. `refusal`
-- makes prepare refuse; `never` makes flat() say the region is never read
-- back; move() puts the residents in a new region.
local function test_memory()
  local memory = { asked = {} }
  local function asked(name)
    memory.asked[name] = (memory.asked[name] or 0) + 1
  end
  function memory.bind(self, plan)
    asked("bind")
    if self.region then
      self.region:close()
    end
    self.region = assert(shm.anonymous(plan.bytes))
  end
  function memory.prepare(self)
    asked("prepare")
    if self.refusal then
      loader_module.refuse(self.refusal)
    end
  end
  function memory.place(_, slice)
    return nil, slice.dst
  end
  function memory.resident(self)
    return self.region
  end
  function memory.flat(self)
    if self.never then
      return nil, self.never
    end
    return self.region
  end
  function memory.host_copy(self)
    asked("host_copy")
    return self.region
  end
  function memory.close_host_copy()
    asked("close_host_copy")
  end
  function memory.state()
    return { weights = "awake", kv_cache = "free" }
  end
  function memory.usage(self)
    return { device_bytes = self.region and self.region:size() or 0, host_bytes = 0 }
  end
  function memory.release(self)
    asked("release")
    if self.region then
      self.region:close()
      self.region = nil
    end
  end
  function memory.move(self)
    local region = assert(shm.anonymous(self.region:size()))
    region:copy_from(self.region, 0, 0, region:size())
    self.region:close()
    self.region = region
  end
  return memory
end

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

-- The tiny model's plan in two 256 KiB buffers (two chunks), this rank's
-- loader plan (under `quantization`), the packed buffers (the trainer's side)
-- and a loader over a test memory, nothing imported. `transport` defaults to
-- shm.
local function setup(transport, quantization)
  local plan = plan_module.build({ family = "qwen3_moe", config = "tiny", quantization = quantization },
    { bytes = BUFFER_BYTES, count = 2 })
  local loader_plan = plan_module.family("qwen3_moe").loader_plan(plan.config, TP, RANK, quantization)
  local own = assert(shm_transport.create(2, BUFFER_BYTES))
  local memory = test_memory()
  local loader = loader_module.new({ rank = RANK, world = TP, device = { backend = "host", index = 0, uuid = "u" },
    transport = transport or shm_transport, context = { device = 0 }, memory = memory })
  local function close()
    loader:release_all()
    shm_transport.release(own)
  end
  return { plan = plan, loader_plan = loader_plan, own = own, memory = memory, loader = loader, close = close }
end

local function init_payload(state, changes)
  local payload = { family = "qwen3_moe", config = "tiny", tp = TP, transport = "shm",
    buffers = shm_transport.descriptors(state.own) }
  for key, value in pairs(changes or {}) do
    payload[key] = value
  end
  return payload
end

-- Chunk k's slot (the chunks take the buffers in turn), filled with bytes
-- of seed `seed`.
local function fill_chunk(state, k, seed)
  local slot = (k - 1) % 2 + 1
  fill_random(state.own.buffers[slot], seed)
  return slot
end

-- Whether every row of every slice that chunk k fills on this rank holds
-- the bytes the packed buffer has there.
local function landed(state, k, slot)
  local buffer, region = state.own.buffers[slot], state.memory.region
  for _, tensor in ipairs(state.plan.chunks[k].tensors) do
    for _, slice in ipairs(state.loader_plan.copies[tensor.name] or {}) do
      for row = 0, slice.rows - 1 do
        if buffer:read(tensor.offset + slice.src + row * slice.src_pitch, slice.width)
            ~= region:read(slice.dst + row * slice.dst_pitch, slice.width) then
          return false, string.format("%s, row %d", tensor.name, row)
        end
      end
    end
  end
  return true
end

-- Runs one publication of every chunk, each filled with fresh bytes; with
-- `metadata`, each load carries its chunk's tensors. The receipt and the
-- bytes the loads reported.
local function publish(state, header, metadata, seed)
  assert.are.same({}, state.loader:start_update({ header = header }))
  local bytes = 0
  for k, chunk in ipairs(state.plan.chunks) do
    local slot = fill_chunk(state, k, seed + k)
    local result = state.loader:load_chunk({ chunk = k, buffer = slot, tensors = metadata and chunk.tensors or nil })
    assert.are.equal(RANK, result.rank)
    assert.are.equal(#chunk.tensors, result.tensors)
    bytes = bytes + result.bytes
    assert(landed(state, k, slot))
  end
  local receipt = state.loader:finish_update({ publication_id = header.publication_id,
    model_version = header.model_version })
  return receipt, bytes
end

local function failing(method)
  return setmetatable({}, { __index = function(_, name)
    if name == method then
      return function()
        return nil, "injected " .. method .. " failure", "WS_ECRYPTO"
      end
    end
    return function() end
  end })
end

describe("wsync.runtime.loader", function()
  it("refuses a memory that lacks a method of the interface", function()
    local memory = test_memory()
    memory.place = nil
    local ok, err = pcall(loader_module.new, { rank = 0, world = 1, device = {}, transport = shm_transport,
      context = {}, memory = memory })
    assert.is_false(ok)
    assert.matches("a loader's memory lacks place", err, 1, true)
  end)

  it("has the memory hold the loader plan's residents and maps the rank's buffers at init_weights", function()
    local state = setup()
    local result = state.loader:init_weights(init_payload(state))
    assert.are.same({ resident_tensors = #state.loader_plan.tensors, resident_bytes = state.loader_plan.bytes,
      buffers = 2, ordered = false }, result)
    assert.are.equal(1, state.memory.asked.bind)
    assert.are.equal(state.loader_plan.bytes, state.memory.region:size())
    assert.are.equal(2, state.loader:mapped_count())
    local info = state.loader:info()
    assert.are.same({ RANK, TP, "u" }, { info.rank, info.world, info.device.uuid })
    assert.are.same({ weights = "awake", kv_cache = "free" }, info.state)
    assert.are.equal(state.loader_plan.bytes, info.memory.device_bytes)
    state.close()
    assert.are.equal(1, state.memory.asked.release)
    assert.are.equal(0, state.loader:mapped_count())
  end)

  it("loads every chunk where the loader plan puts it, and answers the receipt of what it loaded", function()
    local state = setup()
    state.loader:init_weights(init_payload(state))
    local ok, receipt, bytes = pcall(publish, state, HEADER, true, 1)
    state.close()
    assert(ok, receipt)
    assert.are.same({
      publication_id = HEADER.publication_id, model_version = 3, tp_rank = RANK, tp_world = TP, uuid = "u",
      manifest = state.plan.manifest, tensors = #state.plan.canonical, bytes = bytes,
      resident_tensors = #state.loader_plan.tensors,
    }, receipt)
    assert.is_true(bytes > 0)
  end)

  it("lists each resident tensor a chunk fills once, however many of its slices fill it", function()
    local state = setup()
    state.loader:init_weights(init_payload(state))
    local ok, receipt = pcall(publish, state, HEADER, true, 1)
    local chunks = {}
    for k = 1, #state.plan.chunks do
      chunks[k] = state.loader.load_plans:get(k)
    end
    state.close()
    assert(ok, receipt)
    local slices, listed = 0, 0
    for k = 1, #state.plan.chunks do
      local chunk = chunks[k]
      local seen = {}
      for _, index in ipairs(chunk.residents) do
        assert.is_nil(seen[index], "chunk " .. k .. " lists resident " .. index .. " twice")
        seen[index] = true
      end
      slices, listed = slices + #chunk.copies, listed + #chunk.residents
    end
    assert.is_true(slices > listed, "no resident is filled by several slices: the case is not tested")
    assert.are.equal(#state.loader_plan.tensors, receipt.resident_tensors)
  end)

  it("loads a later publication from the chunks' kept plans, their metadata omitted", function()
    local state = setup()
    state.loader:init_weights(init_payload(state))
    local later = { publication_id = string.rep("cd", 16), model_version = 4 }
    local ok, first, receipt = pcall(function()
      return publish(state, HEADER, true, 1), publish(state, later, false, 100)
    end)
    state.close()
    assert(ok, first)
    assert.are.equal(later.publication_id, receipt.publication_id)
    assert.are.equal(4, receipt.model_version)
    assert.are.equal(first.manifest, receipt.manifest)
    assert.are.equal(first.resident_tensors, receipt.resident_tensors)
  end)

  it("plans a chunk's load again when the memory moved, on a transport whose plans hold addresses", function()
    local planned = 0
    local transport = setmetatable({
      BINDS_MEMORY = true,
      plan_load = function(...)
        planned = planned + 1
        return shm_transport.plan_load(...)
      end,
    }, { __index = shm_transport })
    local state = setup(transport)
    state.loader:init_weights(init_payload(state))
    local ok, message = pcall(function()
      publish(state, HEADER, true, 1)
      assert.are.equal(2, planned)
      publish(state, { publication_id = string.rep("cd", 16), model_version = 4 }, false, 2)
      assert.are.equal(2, planned) -- (the same memory: the plans are kept)
      state.memory:move()
      publish(state, { publication_id = string.rep("ef", 16), model_version = 5 }, false, 3)
      assert.are.equal(4, planned)
    end)
    state.close()
    assert(ok, message)
  end)

  it("refuses, fatally, the weight commands out of order or naming what it does not have", function()
    local state = setup()
    local function refused(code, method, payload)
      local err = error_of(state.loader[method], state.loader, payload)
      assert.are.equal(code, err.code)
      assert.is_true(err.fatal)
      return err.message
    end
    local ok, message = pcall(function()
      assert.matches("start_update before init_weights", refused("NOT_INITIALIZED", "start_update",
        { header = HEADER }), 1, true)
      assert.matches("init_weights for TP 4", refused("TOPOLOGY", "init_weights", init_payload(state, { tp = 4 })),
        1, true)
      assert.matches("init_weights for transport cuda_ipc", refused("TRANSPORT", "init_weights",
        init_payload(state, { transport = "cuda_ipc" })), 1, true)
      state.loader:init_weights(init_payload(state))
      assert.matches("load_chunk outside start_update/finish_update", refused("NOT_UPDATING", "load_chunk",
        { chunk = 1, buffer = 1, tensors = state.plan.chunks[1].tensors }), 1, true)
      assert.matches("finish_update without start_update", refused("NOT_UPDATING", "finish_update", HEADER), 1, true)
      state.loader:start_update({ header = HEADER })
      assert.matches("chunk 1 comes without tensor metadata", refused("BAD_METADATA", "load_chunk",
        { chunk = 1, buffer = 1 }), 1, true)
      assert.matches("load_chunk names buffer 3; 2 are mapped", refused("NO_BUFFER", "load_chunk",
        { chunk = 1, buffer = 3, tensors = state.plan.chunks[1].tensors }), 1, true)
      assert.matches("TP worker 1 has no loader plan for nonsense", refused("UNKNOWN_TENSOR", "load_chunk",
        { chunk = 1, buffer = 1, tensors = { { name = "nonsense", dtype = "bfloat16", shape = { 1 }, offset = 0,
          bytes = 2 } } }), 1, true)
      assert.matches("TP worker 1: load_chunk ordered on the device, and init_weights mapped no gate",
        refused("NO_GATE", "load_chunk", { chunk = 1, buffer = 1, tensors = state.plan.chunks[1].tensors,
          gate = { seq = 1, last = true } }), 1, true)
      assert.matches("finish_update for publication " .. string.rep("cd", 16), refused("WRONG_PUBLICATION",
        "finish_update", { publication_id = string.rep("cd", 16), model_version = 3 }), 1, true)
      assert.is_true(state.loader:updating())
    end)
    state.close()
    assert(ok, message)
  end)

  it("leaves to the memory whether its residents can be written: its refusal enters no update", function()
    local state = setup()
    state.loader:init_weights(init_payload(state))
    state.memory.refusal = "cannot update weights that are offloaded: wake weights first"
    local err = error_of(state.loader.start_update, state.loader, { header = HEADER })
    state.close()
    assert.are.equal("STATE_REFUSED", err.code)
    assert.is_nil(err.fatal)
    assert.are.equal(state.memory.refusal, err.message)
    assert.is_false(state.loader:updating())
  end)

  it("reads the residents back through the memory, or refuses as the memory says", function()
    local state = setup()
    local ok, message = pcall(function()
      assert.matches("no resident weights to checksum (not initialized, or asleep)",
        error_of(state.loader.resident_checksums, state.loader).message, 1, true)
      state.loader:init_weights(init_payload(state))
      publish(state, HEADER, true, 1)
      local sums = state.loader:resident_checksums().tensors
      for _, tensor in ipairs(state.loader_plan.tensors) do
        assert.are.equal(state.memory.region:sha256(tensor.offset, tensor.bytes), sums[tensor.name])
      end
      assert.are.equal(64, #state.loader:weights_digest().digest)
      local values = state.loader:resident_values()
      assert.are.equal(RANK, values.rank)
      assert.are.equal(#state.loader_plan.tensors, #require("wsync.util").sorted_keys(values.tensors))
      assert.are.same({ 1, 1 }, { state.memory.asked.host_copy, state.memory.asked.close_host_copy })
      assert.matches("the shm transport checks resident weights on the host",
        error_of(state.loader.resident_check, state.loader, { step = 1 }).message, 1, true)
      state.memory.never = "the resident tensors are not this worker's to read back"
      local err = error_of(state.loader.resident_checksums, state.loader)
      assert.are.same({ "STATE_REFUSED", state.memory.never }, { err.code, err.message })
      assert.are.equal(state.memory.never, error_of(state.loader.resident_check, state.loader, { step = 1 }).message)
      assert.matches("no resident weights to digest (asleep, or the engine's)",
        error_of(state.loader.weights_digest, state.loader).message, 1, true)
    end)
    state.close()
    assert(ok, message)
  end)

  it("turns a manifest that cannot be made into a fatal MANIFEST error naming the worker", function()
    local loader = loader_module.new({ rank = 1, world = 2, device = { uuid = "u" }, transport = shm_transport,
      context = {}, memory = test_memory() })
    loader.load_plans = failing("manifest")
    loader.update = { header = HEADER, loaded = { 1 }, tensors = 0, bytes = 0, touched = 0 }
    local ok, err = pcall(loader.finish_update, loader, { publication_id = HEADER.publication_id,
      model_version = 3 })
    assert.is_false(ok)
    assert.is_true(errors.is(err), tostring(err))
    assert.are.equal("MANIFEST", err.code)
    assert.is_true(err.fatal)
    assert.matches("TP worker 1: injected manifest failure", err.message, 1, true)
  end)

  describe("with chunks ordered on the device", function()
    -- A loader with chunk 1 planned and a transport that records the gate
    -- each load gets (the cuda transport's, played here: no GPU).
    local function loader_with(gate)
      local loads, settled = {}, {}
      local transport = setmetatable({
        BINDS_MEMORY = false,
        load = function(_, _, _, _, load_gate)
          loads[#loads + 1] = load_gate or false
          return 12, 0
        end,
        settle = function(device)
          settled[#settled + 1] = device
          return true
        end,
      }, { __index = shm_transport })
      local segment = assert(manifest_module.segment())
      assert(segment:add("t", "bfloat16", { 2, 3 }))
      local memory = test_memory()
      memory.region = "weights"
      local loader = loader_module.new({ rank = 0, world = 1, device = { uuid = "u" }, context = { device = 0 },
        transport = transport, memory = memory })
      loader.imported, loader.gate, loader.filled = { "buffer" }, gate, {}
      loader.load_plans:put(1, { copies = {}, residents = {}, tensors = 1, plan = "plan", resident = "weights",
        buffer = "buffer", segment = segment })
      loader.update = { header = HEADER, loaded = {}, tensors = 0, bytes = 0, touched = 0, epoch = 1 }
      return loader, loads, settled
    end

    it("queues a load behind the rank's gate, and waits for the stream at finish when no last load came", function()
      local loader, loads, settled = loader_with("gate mapping")
      loader:load_chunk({ chunk = 1, buffer = 1, gate = { seq = 5, last = false } })
      assert.are.same({ { memory = "gate mapping", seq = 5, last = false } }, loads)
      assert.are.same({}, settled)
      local receipt = loader:finish_update({ publication_id = HEADER.publication_id, model_version = 3 })
      assert.are.same({ 0 }, settled)
      assert.are.equal(1, receipt.tensors)
      loader.load_plans:get(1).segment:close()
    end)

    it("waits for its stream with the last load and not at finish", function()
      local loader, loads, settled = loader_with("gate mapping")
      loader:load_chunk({ chunk = 1, buffer = 1, gate = { seq = 6, last = true } })
      assert.are.same({ { memory = "gate mapping", seq = 6, last = true } }, loads)
      loader:finish_update({ publication_id = HEADER.publication_id, model_version = 3 })
      assert.are.same({}, settled) -- (the transport's load waited: last)
      loader.load_plans:get(1).segment:close()
    end)

    it("refuses, fatally, a load ordered on the device when init_weights mapped no gate", function()
      local loader = loader_with(nil)
      local ok, err = pcall(loader.load_chunk, loader, { chunk = 1, buffer = 1, gate = { seq = 5, last = true } })
      assert.is_false(ok)
      assert.are.equal("NO_GATE", err.code)
      assert.is_true(err.fatal)
      assert.matches("init_weights mapped no gate", err.message, 1, true)
      loader.load_plans:get(1).segment:close()
    end)
  end)
end)

-- Fills `buffer` with bfloat16 values of both signs and magnitudes from 2^-10
-- to 2^21 (no infinity, no NaN).
local function fill_bfloat16(buffer, seed)
  require("tests.helpers.bfloat16").fill(ffi.cast("uint16_t *", buffer:pointer()), buffer:size() / 2, seed, 117, 32)
end

describe("wsync.runtime.loader under fp8", function()
  local fp8 = require("wsync.native.fp8")

  local function bfloat16_at(buffer, offset)
    local bits = ffi.cast("uint16_t *", ffi.cast("uint8_t *", buffer:pointer()) + offset)[0]
    local box = ffi.new("uint32_t[1]", bit.lshift(bits, 16))
    return ffi.cast("float *", box)[0]
  end

  -- What chunk k must leave on this rank, worked out here element by element:
  -- each group's scale from its elements' largest magnitude, each element
  -- quantized under it (the scalar reference), the rest copied. Returns the
  -- first difference, or nil.
  local function difference(state, k, slot)
    local buffer, region = state.own.buffers[slot], state.memory.region
    local bytes = ffi.cast("uint8_t *", region:pointer())
    local groups = {}
    for _, tensor in ipairs(state.plan.chunks[k].tensors) do
      for _, slice in ipairs(state.loader_plan.copies[tensor.name] or {}) do
        for row = 0, slice.rows - 1 do
          local from = tensor.offset + slice.src + row * slice.src_pitch
          if slice.group then
            local group = groups[slice.group] or { amax = 0, elements = {} }
            groups[slice.group] = group
            for column = 0, slice.width / 2 - 1 do
              local value = bfloat16_at(buffer, from + 2 * column)
              group.amax = math.max(group.amax, math.abs(value))
              group.elements[#group.elements + 1] = { value, slice.dst + row * slice.dst_pitch + column }
            end
          elseif buffer:read(from, slice.width) ~= region:read(slice.dst + row * slice.dst_pitch, slice.width) then
            return string.format("%s, row %d", tensor.name, row)
          end
        end
      end
    end
    local checked = 0
    for g, group in pairs(groups) do
      local planned = state.loader_plan.groups[g]
      local scale = fp8.scale(group.amax)
      if ffi.cast("float *", bytes + planned.scale_dst)[0] ~= scale then
        return string.format("the scale of %s", planned.name)
      end
      for _, element in ipairs(group.elements) do
        if bytes[element[2]] ~= fp8.quantize(element[1], scale) then
          return string.format("%s, byte %d", planned.name, element[2])
        end
      end
      checked = checked + 1
    end
    assert.is_true(checked > 0 or k > 1)
    return nil
  end

  it("quantizes each group's slices under one scale as it loads them, and copies the rest", function()
    local state = setup(nil, "fp8")
    assert.are.same({ resident_tensors = #state.loader_plan.tensors, resident_bytes = state.loader_plan.bytes,
      buffers = 2, ordered = false }, state.loader:init_weights(init_payload(state, { quantization = "fp8" })))
    for round = 1, 2 do
      assert.are.same({}, state.loader:start_update({ header = HEADER }))
      for k, chunk in ipairs(state.plan.chunks) do
        local slot = (k - 1) % 2 + 1
        fill_bfloat16(state.own.buffers[slot], 100 * round + k)
        local result = state.loader:load_chunk({ chunk = k, buffer = slot,
          tensors = round == 1 and chunk.tensors or nil })
        assert.are.equal(#chunk.tensors, result.tensors)
        assert.is_nil(difference(state, k, slot))
      end
      local receipt = state.loader:finish_update(HEADER)
      assert.are.equal(#state.loader_plan.tensors, receipt.resident_tensors) -- (the scales counted too)
    end
    state.close()
  end)

  it("refuses a chunk that carries part of a group, naming the parameter, before it moves anything", function()
    local state = setup(nil, "fp8")
    state.loader:init_weights(init_payload(state, { quantization = "fp8" }))
    state.loader:start_update({ header = HEADER })
    local tensors = {}
    for _, tensor in ipairs(state.plan.chunks[1].tensors) do
      if tensor.name ~= "model.layers.0.self_attn.v_proj.weight" then
        tensors[#tensors + 1] = tensor
      end
    end
    assert.is_true(#tensors < #state.plan.chunks[1].tensors)
    fill_bfloat16(state.own.buffers[1], 7)
    local before = state.memory.region:read(0, state.memory.region:size())
    local err = error_of(state.loader.load_chunk, state.loader, { chunk = 1, buffer = 1, tensors = tensors })
    assert.are.equal("PLAN_INVALID", err.code)
    assert.is_true(err.fatal)
    assert.matches("TP worker 1, chunk 1: it carries 2 of the 3 slices under the FP8 scale of "
      .. "model.layers.0.self_attn.qkv_proj.weight (model.layers.0.self_attn.q_proj.weight, "
      .. "model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.v_proj.weight)", err.message, 1, true)
    assert.are.equal(before, state.memory.region:read(0, state.memory.region:size()))
    state.close()
  end)

  it("plans bfloat16 residents, with no transform, without a quantization", function()
    local state = setup()
    state.loader:init_weights(init_payload(state))
    assert.are.same({}, state.loader.plan.groups)
    state.close()
  end)
end)
