-- wsync.publish.memory_probe: device memory after each schedule step, with a
-- stand-in for the driver's library.
local memory_probe = require("wsync.publish.memory_probe")

local GIB = 1024 ^ 3

describe("wsync.publish.memory_probe", function()
  local calls
  local function query(memories)
    return function(uuid)
      calls[#calls + 1] = uuid
      local memory = memories[uuid]
      if type(memory) == "string" then
        return nil, memory, "ENODEV"
      end
      return memory
    end
  end

  before_each(function()
    calls = {}
  end)

  it("samples each device once, in order, naming the run's processes by role", function()
    local probe = memory_probe.new({ "gpu-a", "gpu-b", "gpu-a" }, { [101] = "trainer rank 0" }, query({
      ["gpu-a"] = { used_bytes = 5 * GIB, total_bytes = 80 * GIB, processes = {
        { pid = 101, used_bytes = 2 * GIB }, { pid = 2 ^ 22 + 7 } } },
      ["gpu-b"] = { used_bytes = 1 * GIB, total_bytes = 80 * GIB },
    }))
    local sample = probe:sample()
    assert.are.same({ "gpu-a", "gpu-b" }, calls)
    assert.are.same({
      { device = "gpu-a", used_bytes = 5 * GIB, total_bytes = 80 * GIB, processes = {
        { pid = 101, role = "trainer rank 0", used_bytes = 2 * GIB },
        { pid = 2 ^ 22 + 7, role = "pid 4194311" } } },
      { device = "gpu-b", used_bytes = 1 * GIB, total_bytes = 80 * GIB },
    }, sample)
    assert.are.equal("5.00 GiB (trainer rank 0 2.00, pid 4194311)", memory_probe.describe(sample[1]))
    assert.are.equal("1.00 GiB", memory_probe.describe(sample[2]))
  end)

  it("names a process of this machine that is not the run's by its command", function()
    local pid = require("luv").os_getpid()
    local probe = memory_probe.new({}, {})
    local file = assert(io.open("/proc/self/comm"))
    local command = file:read("*l")
    file:close()
    assert.are.equal(string.format("pid %d (%s)", pid, command), probe:role_of(pid))
  end)

  it("says once why it cannot sample, and asks the driver no more", function()
    local probe = memory_probe.new({ "gpu-a", "gpu-b" }, {}, query({
      ["gpu-a"] = "nvml: cannot load libnvidia-ml.so.1 (the NVIDIA driver's library, for device memory): gone",
    }))
    assert.is_nil(probe:sample())
    assert.is_nil(probe:sample())
    assert.are.same({ "gpu-a" }, calls)
    assert.are.equal("nvml: cannot load libnvidia-ml.so.1 (the NVIDIA driver's library, for device memory): gone",
      probe.unavailable)
  end)
end)

describe("wsync.publish.memory_probe.of_run", function()
  it("watches every rank's and TP worker's device once and names their processes", function()
    local host = require("luv").os_getpid()
    local rollout = {
      state = function()
        return { pid = 300 }
      end,
      workers = function()
        return { { pid = 301, device = { uuid = "gpu-a" } }, { pid = 302, device = { uuid = "gpu-c" } } }
      end,
    }
    local asked = {}
    local probe = memory_probe.of_run({ { rank = 0, device = "gpu-a", pid = host }, { rank = 1, device = "gpu-b",
      pid = 201 } }, rollout, function(uuid)
      asked[#asked + 1] = uuid
      return { used_bytes = 1, total_bytes = 2, processes = {} }
    end)
    assert.are.same({ "gpu-a", "gpu-b", "gpu-c" }, probe.devices)
    assert.are.same({ [host] = "wsync host, trainer rank 0", [201] = "trainer rank 1", [300] = "runtime",
      [301] = "TP worker 0", [302] = "TP worker 1" }, probe.roles)
    assert.are.equal(3, #probe:sample())
    assert.are.same({ "gpu-a", "gpu-b", "gpu-c" }, asked)
  end)

  it("watches only the ranks' devices before the runtime starts", function()
    local probe = memory_probe.of_run({ { rank = 0, device = "gpu-a", pid = 200 } }, nil)
    assert.are.same({ "gpu-a" }, probe.devices)
  end)
end)
