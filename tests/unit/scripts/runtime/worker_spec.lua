-- wsync.runtime.worker: the reference runtime's TP worker over its own
-- memory, through its commands (no process, no channel: M.new on the host
-- backend): dummy weights, sleep and wake, the loader's refusals while the
-- weights sleep, its own refusals during an update. Its runtime failures are
-- coded errors marked fatal (the main process then reports the worker and
-- the host destroys the runtime), never bare assertion errors.
local worker_module = require("wsync.runtime.worker")
local errors = require("wsync.errors")
local shm = require("wsync.native.shm")
local shm_transport = require("wsync.transport.shm")
local error_of = require("tests.helpers.errors").error_of

local WEIGHTS_BYTES, KV_BYTES = 64 * 1024, 4096

-- A worker of TP rank 0 of 1 on the host backend, its dummy weights
-- allocated (`transport`: the shm transport unless given).
local function new_worker(transport)
  local worker = worker_module.new({ rank = 0, world = 1, device = { backend = "host", index = 0, uuid = "u" },
    weights_bytes = WEIGHTS_BYTES, kv_bytes = KV_BYTES, transport = transport })
  assert(worker.memory:allocate_dummy())
  return worker
end

-- The SHA-256 of `bytes` zero bytes.
local function zeros_sum(bytes)
  local zeros = assert(shm.anonymous(bytes))
  local sum = zeros:sha256(0, bytes)
  zeros:close()
  return sum
end

describe("wsync.runtime.worker", function()
  it("starts an update with the first load_chunk that brings its start, before it loads", function()
    local worker = new_worker()
    local own = assert(shm_transport.create(2, 256 * 1024))
    local header = { publication_id = string.rep("ab", 16), model_version = 1 }
    local ok, message = pcall(function()
      worker.loader:init_weights({ family = "qwen3_moe", config = "tiny", tp = 1, transport = "shm",
        buffers = shm_transport.descriptors(own) })
      -- (No tensor metadata came: the load itself fails, after the start.)
      local err = error_of(worker.load_chunk, worker, { chunk = 1, buffer = 1, start = { header = header } })
      assert.are.equal("BAD_METADATA", err.code)
      assert.is_true(worker.loader:updating())
      worker.loader:finish_update(header)
      worker:sleep({ level = 1 })
      err = error_of(worker.load_chunk, worker, { chunk = 1, buffer = 1, start = { header = header } })
      assert.are.same({ "STATE_REFUSED", "cannot update weights that are offloaded: wake weights first" },
        { err.code, err.message })
      assert.is_false(worker.loader:updating())
    end)
    worker:release_all()
    shm_transport.release(own)
    assert(ok, message)
  end)

  it("answers the last load that brings the update's finish with its receipt, and ends the update", function()
    local worker = new_worker()
    local plan = require("wsync.plan").build({ family = "qwen3_moe", config = "tiny" }, { bytes = 256 * 1024,
      count = 2 })
    local own = assert(shm_transport.create(2, 256 * 1024))
    local header = { publication_id = string.rep("ab", 16), model_version = 1 }
    local ok, message = pcall(function()
      worker.loader:init_weights({ family = "qwen3_moe", config = "tiny", tp = 1, transport = "shm",
        buffers = shm_transport.descriptors(own) })
      local result
      for k, chunk in ipairs(plan.chunks) do
        result = worker:load_chunk({ chunk = k, buffer = (k - 1) % 2 + 1, tensors = chunk.tensors,
          start = k == 1 and { header = header } or nil,
          finish = k == #plan.chunks and { publication_id = header.publication_id, model_version = 1 } or nil })
        assert.are.equal(k == #plan.chunks, result.receipt ~= nil)
      end
      assert.are.same({ header.publication_id, 1, plan.manifest, #plan.canonical }, { result.receipt.publication_id,
        result.receipt.model_version, result.receipt.manifest, result.receipt.tensors })
      assert.is_false(worker.loader:updating())
    end)
    worker:release_all()
    shm_transport.release(own)
    assert(ok, message)
  end)

  it("turns a level-1 copy that fails into a fatal COPY_FAILED error", function()
    local transport = setmetatable({ copy_host = function()
      error("injected copy failure")
    end }, { __index = shm_transport })
    local worker = new_worker(transport)
    local ok, err = pcall(worker.sleep, worker, { level = 1 })
    worker:release_all()
    assert.is_false(ok)
    assert.is_true(errors.is(err), tostring(err))
    assert.are.equal("COPY_FAILED", err.code)
    assert.is_true(err.fatal)
  end)

  it("starts on the rank's dummy weights, and sleeps and wakes its own memory", function()
    local worker = new_worker()
    local ok, message = pcall(function()
      local info = worker:info()
      assert.are.same({ weights = "awake", kv_cache = "free" }, info.state)
      assert.are.same({ device_bytes = WEIGHTS_BYTES, host_bytes = 0 }, info.memory)
      assert.are.equal("u", info.device.uuid)
      local dummy = worker:checksum().weights
      assert.are_not.equal(zeros_sum(WEIGHTS_BYTES), dummy)
      assert.are.equal(64, #worker.loader:weights_digest().digest) -- (4 KiB of the dummy weights: no plan yet)
      info = worker:wake({ tags = { "kv_cache" } })
      assert.are.same({ weights = "awake", kv_cache = "reserved" }, info.state)
      assert.are.equal(WEIGHTS_BYTES + KV_BYTES, info.memory.device_bytes)
      assert.are.equal(zeros_sum(KV_BYTES), worker:checksum().kv_cache)
      -- Level 1: the weights in a host copy, restored by a wake.
      info = worker:sleep({ level = 1 })
      assert.are.same({ weights = "offloaded", kv_cache = "free" }, info.state)
      assert.are.same({ device_bytes = 0, host_bytes = WEIGHTS_BYTES }, info.memory)
      assert.are.same({ rank = 0 }, worker:checksum())
      local err = error_of(worker.wake, worker, { tags = { "kv_cache" } })
      assert.are.same({ "STATE_REFUSED", "cannot wake kv_cache while the weights are offloaded: wake weights first" },
        { err.code, err.message })
      info = worker:wake({ tags = { "weights", "kv_cache" } })
      assert.are.same({ weights = "awake", kv_cache = "reserved" }, info.state)
      assert.are.equal(0, info.memory.host_bytes)
      assert.are.equal(dummy, worker:checksum().weights)
      -- Level 2: discarded, woken zeroed.
      assert.are.same({ weights = "discarded", kv_cache = "free" }, worker:sleep({ level = 2 }).state)
      worker:wake({ tags = { "weights" } })
      assert.are.equal(zeros_sum(WEIGHTS_BYTES), worker:checksum().weights)
      assert.are.equal("INVALID_ARGUMENT", error_of(worker.sleep, worker, { level = 3 }).code)
      assert.are.equal("INVALID_ARGUMENT", error_of(worker.wake, worker, { tags = { "everything" } }).code)
      assert.are.equal("INVALID_ARGUMENT", error_of(worker.wake, worker, { tags = {} }).code)
    end)
    worker:release_all()
    assert(ok, message)
    assert.are.same({ device_bytes = 0, host_bytes = 0 }, worker:info().memory)
  end)

  it("sizes its weights to the loader plan, refuses an update of weights that sleep, and sleep or release during "
    .. "an update", function()
    local worker = new_worker()
    local own = assert(shm_transport.create(2, 256 * 1024))
    local header = { publication_id = string.rep("ab", 16), model_version = 1 }
    local init = { family = "qwen3_moe", config = "tiny", tp = 1, transport = "shm",
      buffers = shm_transport.descriptors(own) }
    local ok, message = pcall(function()
      local bytes = worker.loader:init_weights(init).resident_bytes
      assert.are.same({ device_bytes = bytes, host_bytes = 0 }, worker:info().memory)
      assert.are.equal(zeros_sum(bytes), worker:checksum().weights)
      worker.loader:start_update({ header = header })
      local err = error_of(worker.sleep, worker, { level = 1 })
      assert.are.same({ "STATE_REFUSED", "cannot sleep during a weight update" }, { err.code, err.message })
      assert.are.equal("release during an update", error_of(worker.release, worker).message)
      worker.loader:finish_update(header)
      assert.are.same({ rank = 0, mapped = 2 }, worker:release())
      worker:sleep({ level = 1 })
      err = error_of(worker.loader.start_update, worker.loader, { header = header })
      assert.are.same({ "STATE_REFUSED", "cannot update weights that are offloaded: wake weights first" },
        { err.code, err.message })
      assert.is_nil(err.fatal)
      assert.matches("no resident weights to checksum (not initialized, or asleep)",
        error_of(worker.loader.resident_checksums, worker.loader).message, 1, true)
      -- A new plan while asleep: the host copy is dropped, the wake allocates.
      worker.loader:init_weights(init)
      assert.are.same({ weights = "discarded", kv_cache = "free" }, worker:info().state)
      assert.are.equal(0, worker:info().memory.host_bytes)
      worker:wake({ tags = { "weights" } })
      assert.are.equal(bytes, worker:info().memory.device_bytes)
      assert.is_table(worker.loader:resident_checksums().tensors)
    end)
    worker:release_all()
    shm_transport.release(own)
    assert(ok, message)
  end)
end)
