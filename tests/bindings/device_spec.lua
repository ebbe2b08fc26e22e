-- `wsync._device` and wsync.native.device: device identity and memory from Lua.
local device = require("wsync._device")
local wsync_device = require("wsync.native.device")

local uuid_pattern = "^%x%x%x%x%x%x%x%x%-%x%x%x%x%-%x%x%x%x%-%x%x%x%x%-%x%x%x%x%x%x%x%x%x%x%x%x$"

describe("wsync._device", function()
  it("counts and queries the host backend", function()
    assert.are.equal(64, device.count("host"))
    local info = assert(device.query("host", 1))
    assert.are.equal(1, info.index)
    assert.matches(uuid_pattern, info.uuid)
    assert.are.equal(info.uuid:lower(), info.uuid)
    assert.are.equal("host1", info.name)
    assert.is_true(info.total_bytes >= info.free_bytes)
    assert.is_true(info.total_bytes > 0)
    assert.are_not.equal(info.uuid, device.query("host", 2).uuid)
  end)

  it("is what wsync.native.device exports", function()
    assert.are.equal(device.count, wsync_device.count)
    assert.are.equal(device.query, wsync_device.query)
  end)

  it("returns nil, message, EINVAL for an index out of range", function()
    local result, message, code = device.query("host", 64)
    assert.is_nil(result)
    assert.are.equal("EINVAL", code)
    assert.are.equal("host backend: device 64 out of range 0..63", message)
  end)

  it("raises on a backend or index of the wrong kind", function()
    assert.has_error(function()
      device.count("tpu")
    end, "bad argument #1 to 'count' (invalid option 'tpu')")
    assert.has_error(function()
      device.query(0, 0)
    end, "bad argument #1 to 'query' (invalid option '0')")
    assert.has_error(function()
      device.query("host")
    end, "bad argument #2 to 'query' (number expected, got no value)")
    assert.has_error(function()
      device.query("host", "first")
    end, "bad argument #2 to 'query' (number expected, got string)")
  end)

  it("answers the cuda backend with a count or nil, message, ENODEV", function()
    local count, message, code = device.count("cuda")
    if count then
      assert.is_true(count >= 0)
      return
    end
    assert.are.equal("ENODEV", code)
    assert.matches("^cuda backend: ", message)
    local result, query_message, query_code = device.query("cuda", 0)
    assert.is_nil(result)
    assert.are.equal("ENODEV", query_code)
    assert.are.equal(message, query_message)
  end)

  describe("gpu_memory (NVML)", function()
    local uv = require("luv")
    local directory

    -- Runs `code` in a wsync of its own (NVML is opened once per process)
    -- with $WSYNC_NVML_LIBRARY set to `library` (and `env`, NAME=VALUE);
    -- returns what it printed.
    local function run(library, code, env)
      local command = string.format("%s WSYNC_NVML_LIBRARY='%s' '%s' -e '%s' 2>&1", env or "", library, uv.exepath(),
        code)
      local pipe = assert(io.popen(command))
      local output = pipe:read("*a")
      pipe:close()
      return output
    end

    setup(function()
      directory = assert(uv.fs_mkdtemp((os.getenv("TMPDIR") or "/tmp") .. "/wsync-nvml-spec-XXXXXX"))
      local built = os.execute(string.format("cc -shared -fPIC -o '%s/libfake_nvml.so' tests/fixtures/nvml/fake_nvml.c",
        directory))
      assert(built == 0 or built == true, "cc could not build tests/fixtures/nvml/fake_nvml.c")
    end)

    teardown(function()
      os.remove(directory .. "/libfake_nvml.so")
      uv.fs_rmdir(directory)
    end)

    it("is what wsync.native.device exports", function()
      assert.are.equal(device.gpu_memory, wsync_device.gpu_memory)
    end)

    local READ = [[
        local m = assert(require("wsync._device").gpu_memory("aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"))
        print(string.format("%.0f %.0f %.0f %.0f %d", m.total_bytes, m.used_bytes, m.free_bytes, m.reserved_bytes,
          #m.processes))
        for _, p in ipairs(m.processes) do print(p.pid, p.used_bytes and string.format("%.0f", p.used_bytes)) end]]

    it("reads a GPU's memory and its processes by UUID, the driver's reserve apart", function()
      -- (total is what processes can hold, as CUDA's total is: NVML's less
      -- the driver's reserve; used is that total less free.)
      assert.are.equal("79500000000 49500000000 30000000000 500000000 2\n101\t1000000000\n102\tnil\n",
        run(directory .. "/libfake_nvml.so", READ))
    end)

    it("counts the reserve in total and used where the driver names it nowhere (NVML's memory info v1)", function()
      assert.are.equal("80000000000 50000000000 30000000000 0 2\n101\t1000000000\n102\tnil\n",
        run(directory .. "/libfake_nvml.so", READ, "FAKE_NVML_V1=1"))
    end)

    it("names a GPU it does not have", function()
      local output = run(directory .. "/libfake_nvml.so", [[
        print(require("wsync._device").gpu_memory("00000000-bbbb-cccc-dddd-eeeeeeeeeeee"))]])
      assert.are.equal("nil\tnvml: no GPU GPU-00000000-bbbb-cccc-dddd-eeeeeeeeeeee: Not Found\tENOTFOUND\n", output)
    end)

    it("says why where the driver's library is missing", function()
      local output = run(directory .. "/missing.so", [[
        print(require("wsync._device").gpu_memory("aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"))]])
      assert.matches("^nil\tnvml: cannot load " .. directory:gsub("%p", "%%%0") .. "/missing.so %(the NVIDIA driver's "
        .. "library, for device memory%): .*\tENODEV\n$", output)
    end)
  end)
end)

