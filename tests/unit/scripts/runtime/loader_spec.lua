-- wsync.runtime.loader: a TP rank's loader's runtime failures are coded
-- errors marked fatal (the main process then reports the worker and the host
-- destroys the runtime), never bare assertion errors. The loader writes into
-- a memory of the test's own (a wsync.ResidentMemory).
local errors = require("wsync.errors")
local loader_module = require("wsync.runtime.loader")
local manifest_module = require("wsync.native.manifest")
local shm = require("wsync.native.shm")
local shm_transport = require("wsync.transport.shm")

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
  it("turns a manifest that cannot be made into a fatal MANIFEST error naming the worker", function()
    local loader = loader_module.new({ rank = 1, world = 2, device = { uuid = "u" }, transport = shm_transport,
      context = {}, memory = test_memory() })
    loader.digests = failing("of")
    loader.update = { header = HEADER, loaded = { 1 }, tensors = 0, bytes = 0, touched = 0 }
    local ok, err = pcall(loader.finish_update, loader, { publication_id = HEADER.publication_id,
      model_version = 3 })
    assert.is_false(ok)
    assert.is_true(errors.is(err), tostring(err))
    assert.are.equal("MANIFEST", err.code)
    assert.is_true(err.fatal)
    assert.matches("TP worker 1: injected of failure", err.message, 1, true)
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
      loader.chunks = { { copies = {}, residents = {}, tensors = 1, plan = "plan", resident = "weights",
        buffer = "buffer", segment = segment } }
      loader.segments = { segment }
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
      loader.chunks[1].segment:close()
    end)

    it("waits for its stream with the last load and not at finish", function()
      local loader, loads, settled = loader_with("gate mapping")
      loader:load_chunk({ chunk = 1, buffer = 1, gate = { seq = 6, last = true } })
      assert.are.same({ { memory = "gate mapping", seq = 6, last = true } }, loads)
      loader:finish_update({ publication_id = HEADER.publication_id, model_version = 3 })
      assert.are.same({}, settled) -- (the transport's load waited: last)
      loader.chunks[1].segment:close()
    end)

    it("refuses, fatally, a load ordered on the device when init_weights mapped no gate", function()
      local loader = loader_with(nil)
      local ok, err = pcall(loader.load_chunk, loader, { chunk = 1, buffer = 1, gate = { seq = 5, last = true } })
      assert.is_false(ok)
      assert.are.equal("NO_GATE", err.code)
      assert.is_true(err.fatal)
      assert.matches("init_weights mapped no gate", err.message, 1, true)
      loader.chunks[1].segment:close()
    end)
  end)
end)
