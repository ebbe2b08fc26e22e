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
end)
