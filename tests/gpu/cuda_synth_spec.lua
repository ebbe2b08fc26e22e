-- Synthetic values on a GPU (host/cuda_plan.c, host/cuda_kernels.cu): what
-- one launch writes is bitwise what ws_synth_fill writes on the host, for
-- bfloat16 and float32, whole tensors, FSDP shards (a first element) and TP
-- slices (strided rows); a check launch counts mismatches and names the first
-- one. Without a usable device the whole file is reported as pending.
local ffi = require("ffi")
local support = require("tests.gpu.support")
local cuda = require("wsync._cuda")
local C = support.C

local count, reason = support.devices()

local MiB = 1024 * 1024
local BYTES = 24 * MiB

local ELEMENT_BYTES = { bfloat16 = 2, float32 = 4 }
local DTYPES = { bfloat16 = C.WS_DTYPE_BFLOAT16, float32 = C.WS_DTYPE_FLOAT32 }

-- What ws_synth_fill writes for `op` at `version` into `host` (the region's
-- mirror), row by row.
local function reference(host, op, version)
  local size = ELEMENT_BYTES[op.dtype or "bfloat16"]
  local rows, elements = op.rows or 1, op.elements
  local pitch = op.pitch or elements * size
  local element_pitch = op.element_pitch or elements
  for row = 0, rows - 1 do
    local status = C.ws_synth_fill(host + (op.offset or 0) + row * pitch, DTYPES[op.dtype or "bfloat16"],
      C.ws_synth_seed(op.name, #op.name), (op.first or 0) + row * element_pitch, elements, version)
    assert(status == 0, ffi.string(C.ws_error_detail()))
  end
end

describe("cuda synthetic values", function()
  if count == 0 then
    pending("no CUDA device: " .. reason)
    return
  end

  local stream, buffer
  setup(function()
    stream = assert(cuda.stream(0))
    buffer = assert(cuda.buffer(0, BYTES))
  end)

  teardown(function()
    assert(buffer:close())
    assert(stream:close())
  end)

  local ops = {
    { name = "model.embed_tokens.weight", elements = 1000003, first = 0 },
    { name = "model.layers.0.mlp.experts.gate_up_proj", elements = 777777, first = 123456789, offset = 2 * MiB },
    { name = "model.norm.weight", dtype = "float32", elements = 300001, offset = 4 * MiB },
    -- a TP slice: 300 rows of 96 elements of a [?, 1000] tensor, from column 200
    { name = "model.layers.1.self_attn.o_proj.weight", rows = 300, elements = 96, pitch = 256,
      first = 200, element_pitch = 1000, offset = 6 * MiB },
    { name = "model.layers.1.mlp.experts.down_proj", dtype = "float32", rows = 1000, elements = 7, pitch = 28,
      first = 5, element_pitch = 7000, offset = 7 * MiB },
    -- one big op, spread over every warp
    { name = "lm_head.weight", elements = 6 * MiB, first = 31, offset = 8 * MiB },
  }

  local function region_ops()
    local list = {}
    for i, op in ipairs(ops) do
      list[i] = { region = 1, name = op.name, dtype = op.dtype, offset = op.offset, rows = op.rows,
        elements = op.elements, pitch = op.pitch, first = op.first, element_pitch = op.element_pitch }
    end
    return list
  end

  it("writes bitwise what ws_synth_fill writes", function()
    assert(buffer:fill(0, BYTES, 0, stream))
    local plan = assert(cuda.synth_plan(0, { buffer }, region_ops()))
    assert(plan:fill(7, stream))
    assert(stream:synchronize())
    local want = support.bytes(BYTES, 0)
    for _, op in ipairs(ops) do
      reference(want, op, 7)
    end
    support.assert_same(ffi.string(want, BYTES), assert(buffer:read(0, BYTES)), "synthetic values")
    assert(plan:close())
  end)

  it("checks every element, counting none wrong after a fill of the same version", function()
    local plan = assert(cuda.synth_plan(0, { buffer }, region_ops()))
    assert(plan:fill(11, stream))
    assert(plan:check(11, stream))
    local result = assert(plan:result())
    assert.are.equal(0, result.mismatches)
    assert.is_nil(result.op)
    assert(plan:close())
  end)

  it("counts nearly every element wrong at another version, the first one first", function()
    local plan = assert(cuda.synth_plan(0, { buffer }, region_ops()))
    assert(plan:fill(11, stream))
    assert(plan:check(12, stream))
    local result = assert(plan:result())
    local total = 0
    for _, op in ipairs(ops) do
      total = total + (op.rows or 1) * op.elements
    end
    -- bfloat16 values of two versions agree by chance about once in 2,300
    assert.is_true(result.mismatches > total * 0.99 and result.mismatches <= total,
      result.mismatches .. " of " .. total)
    assert.are.equal(1, result.op)
    assert(plan:close())
  end)

  it("names the op and tensor element of a single corrupted element", function()
    local plan = assert(cuda.synth_plan(0, { buffer }, region_ops()))
    assert(plan:fill(3, stream))
    assert(stream:synchronize())
    -- row 17, column 5 of op 4 (the o_proj slice)
    local op = ops[4]
    local at = op.offset + 17 * op.pitch + 5 * 2
    local value = assert(buffer:read(at, 2))
    assert(buffer:write(at, string.char(255 - value:byte(1), value:byte(2))))
    assert(plan:check(3, stream))
    local result = assert(plan:result())
    assert.are.equal(1, result.mismatches)
    assert.are.equal(4, result.op)
    assert.are.equal(op.first + 17 * op.element_pitch + 5, result.element)
    assert(plan:close())
  end)

  it("refuses a result before any check", function()
    local plan = assert(cuda.synth_plan(0, { buffer }, region_ops()))
    local result, message, code = plan:result()
    assert.is_nil(result)
    assert.are.equal("ESTATE", code)
    assert.matches("no synthetic check was queued", message, 1, true)
    assert(plan:close())
  end)

  it("refuses a misaligned element before anything runs", function()
    local plan, message, code = cuda.synth_plan(0, { buffer }, { { region = 1, name = "t", elements = 4, offset = 1 } })
    assert.is_nil(plan)
    assert.are.equal("EINVAL", code)
    assert.matches("is not a multiple of the 2-byte element", message, 1, true)
  end)
end)
