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

describe("reference runtime: an update's start", function()
  local async = require("tests.helpers.async")

  -- A runtime over two stand-in workers that record the commands they get
  -- and answer them as a worker would (a receipt for `header()`).
  local function runtime_with_workers(weights)
    local sent = {}
    local state = runtime(2)
    for index = 1, 2 do
      state.workers[index] = {
        request = function(_, cmd, payload)
          sent[#sent + 1] = { rank = index - 1, cmd = cmd, start = payload.start ~= nil,
            finish = payload.finish ~= nil }
          local value = header()
          local receipt = { publication_id = value.publication_id, model_version = value.model_version,
            tp_rank = index - 1, tp_world = 2, uuid = UUIDS[index], manifest = value.manifest, resident_tensors = 21 }
          if cmd == "finish_update" then
            return receipt
          end
          return { bytes = 8, receipt = payload.finish and receipt or nil }
        end,
      }
    end
    state.worker_state = { { weights = weights or "awake" }, { weights = "awake" } }
    state.decoder = { in_flight = function() return 0 end, pause_state = function() end }
    return state, state:handlers(), sent
  end

  local function commands(sent)
    local lines = {}
    for index, entry in ipairs(sent) do
      lines[index] = string.format("%d %s%s%s", entry.rank, entry.cmd, entry.start and " +start" or "",
        entry.finish and " +finish" or "")
    end
    table.sort(lines)
    return lines
  end

  it("starts the workers with the update's first load_chunk, not on its own", function()
    async.run_async(function()
      local state, handlers, sent = runtime_with_workers()
      handlers.start_update({ header = header() })
      assert.are.same({}, sent)
      assert.is_not_nil(state.update)
      handlers.load_chunk({ chunk = 1, buffer = 1 })
      handlers.load_chunk({ chunk = 2, buffer = 2 })
      handlers.finish_update({ publication_id = header().publication_id, model_version = 3 })
      assert.are.same({ "0 finish_update", "0 load_chunk", "0 load_chunk +start", "1 finish_update", "1 load_chunk",
        "1 load_chunk +start" }, commands(sent))
    end)
  end)

  it("has the workers answer their receipts with the last load, and commits them at finish_update", function()
    async.run_async(function()
      local state, handlers, sent = runtime_with_workers()
      handlers.start_update({ header = header() })
      handlers.load_chunk({ chunk = 1, buffer = 1 })
      handlers.load_chunk({ chunk = 2, buffer = 2, last = true })
      local answer = handlers.finish_update({ publication_id = header().publication_id, model_version = 3 })
      assert.are.same({ "0 load_chunk +finish", "0 load_chunk +start", "1 load_chunk +finish", "1 load_chunk +start" },
        commands(sent))
      assert.are.equal(3, answer.model_version)
      assert.are.equal(2, #answer.receipts)
      assert.are.equal(3, state.model_version)
    end)
  end)

  it("refuses, fatally, a finish_update for another publication than the one the last load finished", function()
    async.run_async(function()
      local state, handlers = runtime_with_workers()
      handlers.start_update({ header = header() })
      handlers.load_chunk({ chunk = 1, buffer = 1, last = true })
      local err = error_of(handlers.finish_update, { publication_id = string.rep("cd", 16), model_version = 3 })
      assert.are.equal("WRONG_PUBLICATION", err.code)
      assert.is_true(err.fatal)
      assert.are.equal(2, state.model_version) -- (nothing committed)
    end)
  end)

  it("refuses, fatally, to commit receipts of the last load when a worker broke since", function()
    async.run_async(function()
      local state, handlers = runtime_with_workers()
      handlers.start_update({ header = header() })
      handlers.load_chunk({ chunk = 1, buffer = 1, last = true })
      state.workers[2].state, state.workers[2].cause = "BROKEN", { message = "TP worker 1 exited" }
      local err = error_of(handlers.finish_update, { publication_id = header().publication_id, model_version = 3 })
      assert.are.equal("WORKER_DIED", err.code)
      assert.is_true(err.fatal)
      assert.are.equal(2, state.model_version)
    end)
  end)

  it("starts the workers at finish_update when no chunk loaded", function()
    async.run_async(function()
      local _, handlers, sent = runtime_with_workers()
      handlers.start_update({ header = header() })
      handlers.finish_update({ publication_id = header().publication_id, model_version = 3 })
      assert.are.same({ "0 finish_update", "0 start_update", "1 finish_update", "1 start_update" }, commands(sent))
    end)
  end)

  it("refuses at start_update the update of weights a worker holds asleep, and a sleep during an update",
    function()
      async.run_async(function()
        local _, handlers = runtime_with_workers("offloaded")
        local err = error_of(handlers.start_update, { header = header() })
        assert.are.equal("STATE_REFUSED", err.code)
        assert.matches("cannot update weights that are offloaded (TP worker 0): wake weights first", err.message, 1,
          true)
        local _, awake, sent = runtime_with_workers()
        awake.start_update({ header = header() })
        err = error_of(awake.sleep, { level = 1 })
        assert.are.same({ "STATE_REFUSED", "cannot sleep during a weight update" }, { err.code, err.message })
        assert.are.same({}, sent)
      end)
    end)
end)
