-- wsync.runtime.worker: a TP worker's runtime failures are coded errors
-- marked fatal (the main process then reports the worker and the host
-- destroys the runtime), never bare assertion errors.
local worker_module = require("wsync.runtime.worker")
local errors = require("wsync.errors")
local shm_transport = require("wsync.transport.shm")

local WEIGHTS_BYTES, KV_BYTES = 64, 0

-- A worker of TP rank 0 of 1 on the host backend, its dummy weights
-- allocated (`transport`: the shm transport unless given).
local function new_worker(transport)
  local worker = worker_module.new({ rank = 0, world = 1, device = { backend = "host", index = 0, uuid = "u" },
    weights_bytes = WEIGHTS_BYTES, kv_bytes = KV_BYTES, transport = transport })
  assert(worker.memory:allocate_dummy())
  return worker
end

describe("wsync.runtime.worker", function()
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
end)
