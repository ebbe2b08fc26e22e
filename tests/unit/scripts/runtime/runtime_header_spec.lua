-- The reference runtime's check of a publication header at start_update
-- (shared/DESIGN.md section 5, step 2), every field, and a worker's receipt
-- at finish_update, on runtime and worker states made here (no processes).
local reference = require("wsync.runtime.reference")
local protocol = require("wsync.control.protocol")
local error_of = require("tests.helpers.errors").error_of

local UUIDS = { "00000000-0000-4000-8000-000000000001", "00000000-0000-4000-8000-000000000002" }

local function runtime(committed)
  return setmetatable({
    workers = { {}, {} },
    worker_info = { { device = { uuid = UUIDS[1] } }, { device = { uuid = UUIDS[2] } } },
    transport = "shm",
    model_version = committed,
  }, reference.Runtime)
end

local function header(changes)
  local value = {
    protocol = protocol.VERSION, transport = "shm", publication_id = string.rep("ab", 16), model_version = 3,
    tp_world = 2, manifest = string.rep("0f", 32), uuids = { UUIDS[1], UUIDS[2] }, resident_tensors = { 21, 21 },
  }
  for key, field in pairs(changes or {}) do
    value[key] = field
  end
  return value
end

local function refusal(state, bad)
  local err = error_of(state.check_header, state, bad)
  assert.are.equal("BAD_HEADER", err.code)
  assert.is_true(err.fatal, "a bad header must break the connection")
  return err.message
end

describe("reference runtime: publication header", function()
  it("accepts a header that fits, and keeps the expected resident counts", function()
    local state = runtime(2)
    state:check_header(header())
    assert.are.same({ 21, 21 }, state.expected_resident)
  end)

  it("refuses each wrong field, naming it", function()
    local state = runtime(2)
    assert.matches("protocol 99", refusal(state, header({ protocol = 99 })), 1, true)
    assert.matches("transport cuda_ipc", refusal(state, header({ transport = "cuda_ipc" })), 1, true)
    assert.matches("not 128 bits", refusal(state, header({ publication_id = "abc" })), 1, true)
    assert.matches("not 128 bits", refusal(state, header({ publication_id = string.rep("zz", 16) })), 1, true)
    assert.matches("not a SHA-256", refusal(state, header({ manifest = "0f" })), 1, true)
    assert.matches("header for TP 4", refusal(state, header({ tp_world = 4 })), 1, true)
    assert.matches("puts rank 1 on device", refusal(state, header({ uuids = { UUIDS[1], UUIDS[1] } })), 1, true)
    assert.matches("without the ordered device UUIDs", refusal(state, header({ uuids = false })), 1, true)
  end)

  it("refuses a model version at or below the committed one", function()
    assert.matches("model version 2 does not follow the committed version 2",
      refusal(runtime(2), header({ model_version = 2 })), 1, true)
    assert.matches("model version 1 does not follow", refusal(runtime(2), header({ model_version = 1 })), 1, true)
    assert.matches("model version 2.5", refusal(runtime(2), header({ model_version = 2.5 })), 1, true)
    runtime(nil):check_header(header({ model_version = 1 })) -- a new runtime takes any version from 1
  end)
end)

describe("reference runtime worker: receipts", function()
  local loader_module = require("wsync.runtime.loader")
  local chunk_plans_module = require("wsync.transport.chunk_plans")

  -- A worker's loader in an update, as start_update leaves it (no processes).
  local function updating()
    return setmetatable({
      rank = 1, world = 2, device = { uuid = UUIDS[2] }, load_plans = chunk_plans_module.new(nil),
      update = { header = header(), loaded = {}, tensors = 0, bytes = 0, touched = 0 },
    }, loader_module.Loader)
  end

  it("builds its receipt from the header it got at start_update", function()
    local receipt = updating():finish_update({ publication_id = string.rep("ab", 16), model_version = 3 })
    assert.are.equal(string.rep("ab", 16), receipt.publication_id)
    assert.are.equal(3, receipt.model_version)
    assert.are.equal(1, receipt.tp_rank)
    assert.are.equal(UUIDS[2], receipt.uuid)
  end)

  it("refuses, fatally, to finish a publication other than the one it is updating", function()
    for _, payload in ipairs({
      { publication_id = string.rep("cd", 16), model_version = 3 },
      { publication_id = string.rep("ab", 16), model_version = 4 },
    }) do
      local worker = updating()
      local err = error_of(worker.finish_update, worker, payload)
      assert.are.equal("WRONG_PUBLICATION", err.code)
      assert.is_true(err.fatal)
    end
  end)
end)
