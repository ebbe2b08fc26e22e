-- wsync.runtime.worker: a TP worker's runtime failures are coded errors
-- marked fatal (the main process then reports the worker and the host
-- destroys the runtime), never bare assertion errors.
local worker_module = require("wsync.runtime.worker")
local errors = require("wsync.errors")
local Worker = worker_module.Worker

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

local header = { publication_id = string.rep("a", 32), model_version = 3 }

describe("wsync.runtime.worker", function()
  it("turns a manifest that cannot be made into a fatal MANIFEST error naming the worker", function()
    local worker = setmetatable({ rank = 1, world = 2, device = { uuid = "u" }, digests = failing("of"),
      segments = {}, update = { header = header, loaded = { 1 }, tensors = 0, bytes = 0, touched = 0 } }, Worker)
    local ok, err = pcall(worker.finish_update, worker, { publication_id = header.publication_id,
      model_version = 3 })
    assert.is_false(ok)
    assert.is_true(errors.is(err), tostring(err))
    assert.are.equal("MANIFEST", err.code)
    assert.is_true(err.fatal)
    assert.matches("TP worker 1: injected of failure", err.message, 1, true)
  end)

  it("turns a level-1 copy that fails into a fatal COPY_FAILED error", function()
    local weights = setmetatable({ size = function() return 64 end }, {})
    local worker = setmetatable({ rank = 0, world = 1, weights_state = "awake", weights = weights,
      transport = require("wsync.transport.shm"), close = function() end }, Worker)
    weights.close = function() end
    local ok, err = pcall(worker.sleep, worker, { level = 1 })
    assert.is_false(ok)
    assert.is_true(errors.is(err), tostring(err))
    assert.are.equal("COPY_FAILED", err.code)
    assert.is_true(err.fatal)
  end)

  describe("with chunks ordered on the device", function()
    -- A worker with chunk 1 planned and a transport that records the gate
    -- each load gets (the cuda transport's, played here: no GPU).
    local function worker_with(gate)
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
      }, { __index = require("wsync.transport.shm") })
      local manifest = require("wsync.native.manifest")
      local segment = assert(manifest.segment())
      assert(segment:add("t", "bfloat16", { 2, 3 }))
      local worker = setmetatable({ rank = 0, world = 1, device = { uuid = "u" }, context = { device = 0 },
        transport = transport, imported = { "buffer" }, weights = "weights", gate = gate, filled = {},
        chunks = { { copies = {}, residents = {}, tensors = 1, plan = "plan", resident = "weights",
          buffer = "buffer", segment = segment } }, segments = { segment }, digests = manifest.digest_cache(),
        update = { header = header, loaded = {}, tensors = 0, bytes = 0, touched = 0, epoch = 1 } }, Worker)
      return worker, loads, settled
    end

    it("queues a load behind the rank's gate, and waits for the stream at finish when no last load came", function()
      local worker, loads, settled = worker_with("gate mapping")
      worker:load_chunk({ chunk = 1, buffer = 1, gate = { seq = 5, last = false } })
      assert.are.same({ { memory = "gate mapping", seq = 5, last = false } }, loads)
      assert.are.same({}, settled)
      local receipt = worker:finish_update({ publication_id = header.publication_id, model_version = 3 })
      assert.are.same({ 0 }, settled)
      assert.are.equal(1, receipt.tensors)
      worker.chunks[1].segment:close()
    end)

    it("waits for its stream with the last load and not at finish", function()
      local worker, loads, settled = worker_with("gate mapping")
      worker:load_chunk({ chunk = 1, buffer = 1, gate = { seq = 6, last = true } })
      assert.are.same({ { memory = "gate mapping", seq = 6, last = true } }, loads)
      worker:finish_update({ publication_id = header.publication_id, model_version = 3 })
      assert.are.same({}, settled) -- (the transport's load waited: last)
      worker.chunks[1].segment:close()
    end)

    it("refuses, fatally, a load ordered on the device when init_weights mapped no gate", function()
      local worker = worker_with(nil)
      local ok, err = pcall(worker.load_chunk, worker, { chunk = 1, buffer = 1, gate = { seq = 5, last = true } })
      assert.is_false(ok)
      assert.are.equal("NO_GATE", err.code)
      assert.is_true(err.fatal)
      assert.matches("init_weights mapped no gate", err.message, 1, true)
    end)
  end)
end)
