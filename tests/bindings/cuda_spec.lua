-- `wsync._cuda` and `wsync._nccl` from Lua, on any machine: misuse raises
-- with a readable message before anything reaches the core; a missing GPU
-- is `nil, message, "ENODEV"`. (tests/gpu runs them on a device.)
local cuda = require("wsync._cuda")
local nccl = require("wsync._nccl")
local core = require("wsync._core")
local device = require("wsync._device")

local has_device = (device.count("cuda") or 0) > 0

describe("wsync._cuda", function()
  it("says whether the binary carries the cuda backend", function()
    assert.are.equal(core.cuda_built, cuda.built)
  end)

  it("raises on arguments of the wrong kind", function()
    assert.has_error(function()
      cuda.buffer(-1, 10)
    end, "bad argument #1 to 'buffer' (expected a device index)")
    assert.has_error(function()
      cuda.buffer(0, 0)
    end, "bad argument #2 to 'buffer' (size must be a positive integer)")
    assert.has_error(function()
      cuda.buffer(0, 1.5)
    end, "bad argument #2 to 'buffer' (size must be a positive integer)")
    assert.has_error(function()
      cuda.import(0, "short", 10)
    end, "bad argument #2 to 'import' (expected a 64-byte cudaIpcMemHandle_t)")
    assert.has_error(function()
      cuda.read({ pointer = 1, size = 10 }, 0, 1)
    end, "bad argument #1 to 'read' (region field device must be a non-negative integer below 2^53)")
    assert.has_error(function()
      cuda.read("buffer", 0, 1)
    end, "bad argument #1 to 'read' (region expected (a cuda buffer, a mapping or {pointer, size, device}), got "
      .. "string)")
    assert.has_error(function()
      cuda.read({ pointer = 4096, size = 10, device = 0 }, 8, 4)
    end, "bad argument #3 to 'read' (range exceeds the region)")
    assert.has_error(function()
      cuda.fill({ pointer = 4096, size = 10, device = 0 }, 0, 1, 256)
    end, "bad argument #4 to 'fill' (expected a byte value 0..255)")
  end)

  it("raises on ops it cannot read, naming the op and the field", function()
    local regions = { { pointer = 4096, size = 4096, device = 0 } }
    assert.has_error(function()
      cuda.copy_plan(0, regions, { { target = 1, source = 1 } })
    end, "op 1: field width is missing")
    assert.has_error(function()
      cuda.copy_plan(0, regions, { { target = 1, source = 1, width = 8 }, { target = 0, source = 1, width = 8 } })
    end, "op 2: field target must be a region index from 1")
    assert.has_error(function()
      cuda.copy_plan(0, regions, { { target = 1, source = 1, width = -1 } })
    end, "op 1: field width must be a non-negative integer below 2^53")
    assert.has_error(function()
      cuda.copy_plan(0, regions, { 7 })
    end, "op 1: expected a table, got number")
    assert.has_error(function()
      cuda.copy_plan(0, regions, string.rep("x", 55))
    end, "bad argument #3 to 'copy_plan' (packed ops: length is not a whole number of records)")
    assert.has_error(function()
      cuda.synth_plan(0, regions, { { region = 1, elements = 4, dtype = "bfloat17" } })
    end, "op 1: unknown dtype bfloat17")
    assert.has_error(function()
      cuda.synth_plan(0, regions, { { region = 1, elements = 4 } })
    end, "op 1: field seed is missing")
  end)

  it("returns nil, message, EINVAL for an op outside its region, counting from 0 as the core does", function()
    local plan, message, code = cuda.copy_plan(0, { { pointer = 4096, size = 100, device = 0 } },
      { { target = 1, source = 1, target_offset = 90, width = 20 } })
    assert.is_nil(plan)
    assert.are.equal("EINVAL", code)
    assert.are.equal("cuda copy op 0: target [90, +1 rows x 20, pitch 20) exceeds region 0 (100 bytes)", message)
  end)

  it("reads an FP8 plan's groups and ops, from 1, and returns the core's refusal of them", function()
    local regions = { { pointer = 4096, size = 4096, device = 0 } }
    assert.has_error(function()
      cuda.fp8_plan(0, regions, { { target = 1 } }, {})
    end, "op 1: field scale_offset is missing")
    assert.has_error(function()
      cuda.fp8_plan(0, regions, { { target = 1, scale_offset = 0 } }, { { group = 0, target = 1, source = 1,
        columns = 8 } })
    end, "op 1: field group must be a group index from 1")
    assert.has_error(function()
      cuda.fp8_plan(0, regions, { { target = 1, scale_offset = 0 } }, { { group = 1, target = 1, source = 1 } })
    end, "op 1: field columns is missing")
    local plan, message, code = cuda.fp8_plan(0, regions, { { target = 1, scale_offset = 4094 } },
      { { group = 1, target = 1, source = 1, columns = 8 } })
    assert.is_nil(plan)
    assert.are.equal("EINVAL", code)
    assert.are.equal("fp8 group 0: its float32 scale at byte 4094 exceeds target 0 (4096 bytes)", message)
    plan, message, code = cuda.fp8_plan(0, regions, { { target = 1, scale_offset = 0 } },
      { { group = 1, target = 1, source = 1, columns = 8, source_offset = 4090 } })
    assert.is_nil(plan)
    assert.are.equal("EINVAL", code)
    assert.matches("^fp8 op 0: 1 rows x 8 elements from byte 4090", message)
  end)

  it("returns counters as numbers", function()
    local counters = cuda.counters()
    for _, field in ipairs({ "allocations", "frees", "live_bytes", "exports", "ipc_opens", "ipc_closes",
      "mappings_reused", "live_mappings", "launches" }) do
      assert.is_number(counters[field], field)
    end
  end)

  describe("without a usable GPU", function()
    if has_device then
      pending("a CUDA device is present: tests/gpu covers the cuda backend")
      return
    end

    it("returns nil, message, ENODEV for objects that need a device", function()
      for name, make in pairs({
        buffer = function()
          return cuda.buffer(0, 4096)
        end,
        import = function()
          return cuda.import(0, string.rep("\0", 64), 4096)
        end,
        fp8_plan = function()
          return cuda.fp8_plan(0, { { pointer = 4096, size = 4096, device = 0 } }, { { target = 1, scale_offset = 0 } },
            { { group = 1, target = 1, source = 1, columns = 8, target_offset = 8 } })
        end,
        stream = function()
          return cuda.stream(0)
        end,
        event = function()
          return cuda.event(0, true)
        end,
        copy_plan = function()
          return cuda.copy_plan(0, { { pointer = 4096, size = 64, device = 0 } },
            { { target = 1, source = 1, width = 32, source_offset = 32 } })
        end,
        synth_plan = function()
          return cuda.synth_plan(0, { { pointer = 4096, size = 64, device = 0 } },
            { { region = 1, elements = 8, name = "t" } })
        end,
      }) do
        local object, message, code = make()
        assert.is_nil(object, name)
        assert.are.equal("ENODEV", code, name)
        assert.matches("^cuda", message)
      end
    end)
  end)
end)

describe("wsync._nccl", function()
  it("raises on arguments of the wrong kind", function()
    assert.has_error(function()
      nccl.init(0, 2, 2, string.rep("\0", 128))
    end, "bad argument #3 to 'init' (expected a rank of the world)")
    assert.has_error(function()
      nccl.init(0, 1, 0, "id")
    end, "bad argument #4 to 'init' (expected a 128-byte ncclUniqueId)")
  end)
end)
