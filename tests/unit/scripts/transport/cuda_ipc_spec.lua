-- wsync.transport.cuda_ipc where no GPU is usable (CI): every call that
-- needs the device fails with a clear error naming it, and malformed
-- descriptors are refused before anything is mapped. (tests/gpu runs it.)
local transport = require("wsync.transport")

local function gpu_count()
  local count = require("wsync.native.device").count("cuda")
  return count or 0
end

describe("wsync.transport.cuda_ipc without a GPU", function()
  it("is the cuda backend's transport, named cuda_ipc in the header", function()
    assert.are.equal("cuda_ipc", transport.name("cuda"))
    assert.are.equal("shm", transport.name("host"))
  end)

  it("refuses a backend this build has no transport for, naming it", function()
    local ok, err = pcall(transport.for_backend, "tpu")
    assert.is_false(ok)
    assert.are.equal("TRANSPORT", err.code)
    assert.matches("no transport for the tpu backend in this build (it has: cuda, host)", err.message, 1, true)
  end)

  it("tiles copy plans by 64 KiB and copies joined runs of 16 MiB or more with CUDA's own copy, or as "
    .. "$WSYNC_CUDA_COPY_TILE and $WSYNC_CUDA_COPY_BULK say (0: per-warp ranges, no bulk copies), refusing bad values",
    function()
    local uv = require("luv")
    local cuda_ipc = require("wsync.transport.cuda_ipc")
    local saved = { tile = os.getenv("WSYNC_CUDA_COPY_TILE"), bulk = os.getenv("WSYNC_CUDA_COPY_BULK") }
    local MiB16 = 16 * 1024 * 1024
    local ok, err = pcall(function()
      uv.os_unsetenv("WSYNC_CUDA_COPY_TILE")
      uv.os_unsetenv("WSYNC_CUDA_COPY_BULK")
      assert.are.same({ tile = 65536, bulk = MiB16 }, cuda_ipc.copy_options())
      uv.os_setenv("WSYNC_CUDA_COPY_TILE", "")
      assert.are.same({ tile = 65536, bulk = MiB16 }, cuda_ipc.copy_options())
      uv.os_setenv("WSYNC_CUDA_COPY_TILE", "0")
      assert.are.same({ bulk = MiB16 }, cuda_ipc.copy_options()) -- (the per-warp ranges)
      uv.os_setenv("WSYNC_CUDA_COPY_TILE", "65536")
      uv.os_setenv("WSYNC_CUDA_COPY_BULK", "0")
      assert.are.same({ tile = 65536 }, cuda_ipc.copy_options())
      uv.os_setenv("WSYNC_CUDA_COPY_BULK", "1048576")
      assert.are.same({ tile = 65536, bulk = 1048576 }, cuda_ipc.copy_options())
      uv.os_unsetenv("WSYNC_CUDA_COPY_BULK")
      for _, value in ipairs({ "1000", "big", "256", tostring(128 * 1024 * 1024) }) do
        uv.os_setenv("WSYNC_CUDA_COPY_TILE", value)
        local options, message, code = cuda_ipc.copy_options()
        assert.is_nil(options)
        assert.are.equal("WS_EINVAL", code)
        assert.matches("WSYNC_CUDA_COPY_TILE=" .. value .. " is not a number of bytes that is a multiple of 512",
          message, 1, true)
      end
      uv.os_unsetenv("WSYNC_CUDA_COPY_TILE")
      for _, value in ipairs({ "-1", "1.5", "lots" }) do
        uv.os_setenv("WSYNC_CUDA_COPY_BULK", value)
        local options, message, code = cuda_ipc.copy_options()
        assert.is_nil(options)
        assert.are.equal("WS_EINVAL", code)
        assert.are.equal("WSYNC_CUDA_COPY_BULK=" .. value .. " is not a whole number of bytes", message)
      end
    end)
    for name, value in pairs(saved) do
      local variable = "WSYNC_CUDA_COPY_" .. name:upper()
      if value then
        uv.os_setenv(variable, value)
      else
        uv.os_unsetenv(variable)
      end
    end
    assert(ok, err)
  end)

  it("refuses a descriptor that is no cuda_ipc descriptor before mapping anything", function()
    if not require("wsync").cuda_built then
      pending("this build has no cuda")
      return
    end
    local imported, message = transport.for_backend("cuda").import({ "/wsync-123-shm-name" }, { device = 0 })
    assert.is_nil(imported)
    assert.matches('buffer 1: "/wsync%-123%-shm%-name" is not a cuda_ipc descriptor', message)
  end)

  it("fails to create buffers where no device is usable, saying why", function()
    if not require("wsync").cuda_built or gpu_count() > 0 then
      pending("this machine has a GPU, or this build no cuda")
      return
    end
    local own, message, code = transport.for_backend("cuda").create(2, 4096, { device = 0 })
    assert.is_nil(own)
    assert.matches("^packed buffer 1 %(4096 bytes%) on GPU 0: ", message)
    assert.are.equal("ENODEV", code)
  end)
end)

describe("wsync.transport.cuda_ipc with chunks ordered on the device", function()
  -- A stream that records what is queued on it (no GPU), and a copy plan.
  local cuda_ipc = require("wsync.transport.cuda_ipc")
  local queued, stream, plan
  before_each(function()
    queued = {}
    stream = {
      wait_value = function(_, memory, offset, value)
        queued[#queued + 1] = string.format("wait %s@%d >= %d", memory, offset, value)
        return true
      end,
      write_value = function(_, memory, offset, value)
        queued[#queued + 1] = string.format("write %s@%d = %d", memory, offset, value)
        return true
      end,
      synchronize = function()
        queued[#queued + 1] = "synchronize"
        return true
      end,
    }
    plan = { copy = { launch = function()
      queued[#queued + 1] = "copy"
      return true
    end, info = function()
      return { bytes = 64 }
    end } }
    cuda_ipc.set_stream(0, stream)
  end)
  after_each(function()
    cuda_ipc.set_stream(0, nil)
  end)

  local GATE = cuda_ipc.GATE
  local targets = { device = 0, gate = "gate", by_slot = {} }

  it("queues a publication's first fill without a wait, a later one behind its worker's last load", function()
    assert.are.same({ 64, 0 }, { cuda_ipc.fill(targets, 1, {}, plan, "fill", { seq = 5 }) })
    assert.are.same({ 64, 0 }, { cuda_ipc.fill(targets, 1, {}, plan, "fill", { after = 5, seq = 6 }) })
    assert.are.same({ "copy", "write gate@" .. GATE.FILLED .. " = 5", "wait gate@" .. GATE.LOADED .. " >= 5", "copy",
      "write gate@" .. GATE.FILLED .. " = 6" }, queued)
  end)

  it("waits for the fill without a gate, as ever", function()
    assert(cuda_ipc.fill(targets, 1, {}, plan, "fill"))
    assert.are.same({ "copy", "synchronize" }, queued)
  end)

  it("refuses a fill ordered on the device on a rank without a gate", function()
    local bytes, message, code = cuda_ipc.fill({ device = 0, by_slot = {} }, 1, {}, plan, "fill", { seq = 1 })
    assert.is_nil(bytes)
    assert.are.equal("WS_ESTATE", code)
    assert.matches("ordered on the device, and this rank has no gate", message, 1, true)
  end)

  it("releases a rank's gate from the host, LOADED written, then waits for its stream", function()
    local gate = { write = function(_, offset, bytes)
      queued[#queued + 1] = string.format("host write @%d = %d", offset,
        bytes:byte(1) + bytes:byte(2) * 256 + bytes:byte(3) * 65536 + bytes:byte(4) * 16777216)
      return true
    end }
    assert(cuda_ipc.release_gate({ device = 0, gate = gate }, 70000))
    assert.are.same({ "host write @" .. GATE.LOADED .. " = 70000", "synchronize" }, queued)
    assert.is_true(cuda_ipc.release_gate({ device = 0 }, 1)) -- (no gate: nothing to release)
  end)

  it("queues loads behind their rank's fill, and waits for the stream with the last", function()
    plan.resident, plan.buffer, plan.device = "weights", "buffer", 0
    assert(cuda_ipc.load("weights", "buffer", plan, "load", { memory = "mapped", seq = 5, last = false }))
    assert(cuda_ipc.load("weights", "buffer", plan, "load", { memory = "mapped", seq = 6, last = true }))
    assert.are.same({ "wait mapped@" .. GATE.FILLED .. " >= 5", "copy", "write mapped@" .. GATE.LOADED .. " = 5",
      "wait mapped@" .. GATE.FILLED .. " >= 6", "copy", "write mapped@" .. GATE.LOADED .. " = 6", "synchronize" },
      queued)
  end)
end)
