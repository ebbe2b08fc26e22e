-- wsync.publish.publication, the host side of one publication, against
-- stand-ins for the trainer ranks and the runtime that record what they are
-- asked: the order of the phases, the consensus gate, double buffering,
-- poison after start and none before, the versions, the receipts' checks.
local async = require("tests.helpers.async")
local errors = require("wsync.errors")
local loop = require("wsync.loop")
local publication_module = require("wsync.publish.publication")
local protocol = require("wsync.control.protocol")
local versions_module = require("wsync.publish.versions")
local uv = require("luv")

local MANIFEST = string.rep("ab", 32)

-- A plan of `chunks` chunks, two buffers, one tensor per chunk.
local function plan_of(chunks, buffers)
  local plan = {
    family = "qwen3_moe", config = {}, manifest = MANIFEST, bytes = 1000, buffer_bytes = 100,
    buffer_count = buffers or 2, largest = { bytes = 10 }, layout = {}, canonical = {}, chunks = {},
    resident_counts = { [2] = { 5, 5 } },
  }
  for k = 1, chunks do
    plan.chunks[k] = { slots = { { name = "t" .. k, offset = 0 } }, tensors = { { name = "t" .. k } } }
  end
  return plan
end

-- Stand-ins: `log` gets one line per call; `fail` = {what = "fill#2", ...}
-- makes that call fail; `delay` (ms) makes fills and loads wait; `exported`
-- is rank 1's manifest at verify (or with the last fill); `no_consumed`:
-- rank 1 answers the last fill without it; `keeps_release`: the runtime's finish
-- answer does not say it released; `start_delay` (ms): start_update
-- waits that long; `fill_delay` (ms): fills wait that long instead of
-- `delay`; `unordered_runtime`: a runtime whose workers cannot wait on the
-- device. The fourth result holds the gates the fills and loads got, and
-- the `begin` and `verify` each fill got (`begins`, `verifies`).
local function stand_ins(options)
  options = options or {}
  local log = {}
  local counts = {}
  local function hit(what)
    counts[what] = (counts[what] or 0) + 1
    local key = what .. "#" .. counts[what]
    log[#log + 1] = key
    if options.fail == key or options.fail == what then
      errors.raise("INJECTED", "injected " .. key, { rank = 1 })
    end
  end
  local function wait(what)
    if options.delay then
      loop.sleep(options.delay)
    end
    log[#log + 1] = "end " .. what
  end
  local ranks = {
    agents = {
      { info = { hostname = uv.os_gethostname(), device = { uuid = "u0", index = 0 } } },
      { info = { hostname = uv.os_gethostname(), device = { uuid = "u1", index = 1 } } },
    },
  }
  function ranks:devices()
    return { 0, 1 }, { "u0", "u1" }
  end
  function ranks:memory()
    hit("memory")
    return { { free_bytes = 1e9 }, { free_bytes = 1e9 } }
  end
  function ranks:check_registration()
    hit("check_registration")
  end
  function ranks:init_buffers(plan)
    hit("init_buffers")
    self.descriptors = { { "a" }, { "b" } }
    return self.descriptors, plan.gated and { "gate a", "gate b" } or nil
  end
  -- (The real numbering: wsync.publish.ranks.)
  ranks.gate_numbers = getmetatable(require("wsync.publish.ranks").new({}, 0)).__index.gate_numbers
  function ranks:all(cmd)
    hit(cmd)
    if cmd == "verify" then
      return { { manifest = MANIFEST, tensors = 1 }, { manifest = options.exported or MANIFEST, tensors = 1 } }
    end
    return { {}, {} }
  end
  local gates = { fills = {}, loads = {}, begins = {}, verifies = {} }
  function ranks:fill(_, k, buffer, _, fields)
    hit("fill")
    log[#log] = log[#log] .. string.format(" chunk %d buffer %d", k, buffer)
    gates.fills[#gates.fills + 1] = fields.gate or false
    gates.begins[#gates.begins + 1] = fields.begin or false
    gates.verifies[#gates.verifies + 1] = fields.verify or false
    if options.fill_delay then
      loop.sleep(options.fill_delay)
      log[#log + 1] = "end fill " .. k
    else
      wait("fill " .. k)
    end
    local reports = { { copy_seconds = 0.001 }, { copy_seconds = 0.002 } }
    if fields.verify then
      reports[1].consumed = { manifest = MANIFEST, tensors = 1 }
      reports[2].consumed = not options.no_consumed and { manifest = options.exported or MANIFEST, tensors = 1 }
        or nil
    end
    return reports
  end
  local header
  local rollout = { destroyed = nil }
  function rollout:workers()
    return { { device = { uuid = "u0" } }, { device = { uuid = "u1" } } }
  end
  function rollout:init_weights(_, _, _, _, gate_names)
    hit("init_weights")
    self.ordered = gate_names ~= nil and not options.unordered_runtime
  end
  function rollout:load_chunk(_, k, buffer, _, gate)
    hit("load")
    log[#log] = log[#log] .. string.format(" chunk %d buffer %d", k, buffer)
    gates.loads[#gates.loads + 1] = gate or false
    wait("load " .. k)
    return { chunk = k, copy_seconds = 0.003 }
  end
  function rollout:request(cmd, payload)
    hit(cmd)
    if cmd == "start_update" then
      header = payload.header
      if options.start_delay then
        loop.sleep(options.start_delay)
        log[#log + 1] = "end start_update"
      end
    elseif cmd == "finish_update" then
      local receipts = {}
      for index, uuid in ipairs(header.uuids) do
        receipts[index] = { publication_id = header.publication_id, model_version = header.model_version,
          tp_rank = index - 1, tp_world = 2, uuid = uuid, manifest = MANIFEST, resident_tensors = 5 }
      end
      return { model_version = options.committed or header.model_version, receipts = receipts,
        prefix_cache_reset = true, released = payload.release and not options.keeps_release or nil }
    end
    return {}
  end
  function rollout:check_finish(checked_header, result)
    require("wsync.runtime.contract").check_finish(checked_header, result)
  end
  function rollout:destroy(cause)
    self.destroyed = cause
    log[#log + 1] = "destroy"
  end
  return ranks, rollout, log, gates
end

-- `options`: the context's trace and serial.
local function new(plan, ranks, rollout, versions, options)
  options = options or {}
  return publication_module.new({
    plan = plan, topology = { world = 2, tp = 2 }, ranks = ranks, rollout = rollout,
    versions = versions or versions_module.new(), timeouts = { start = 1, init = 1, fill = 1, verify = 1 },
    transport = "shm", step = 1, trace = options.trace, serial = options.serial,
  })
end

describe("wsync.publish.publication", function()
  it("runs its phases in order and commits the version it was given", function()
    async.run_async(function()
      local ranks, rollout, log, seen = stand_ins()
      local versions = versions_module.new()
      local report = new(plan_of(1), ranks, rollout, versions):run()
      -- (verify with the last fill's answers, while it loads; release in
      -- finish_update's answer)
      assert.are.same({ "memory#1", "check_registration#1", "init_buffers#1", "init_weights#1",
        "start_update#1", "fill#1 chunk 1 buffer 1", "end fill 1",
        "load#1 chunk 1 buffer 1", "end load 1", "finish_update#1" }, log)
      assert.are.same({ true }, seen.verifies)
      assert.are.equal(1, report.model_version)
      assert.are.equal(1, versions.committed)
      assert.are.equal(protocol.VERSION, 1) -- (the header's protocol)
      -- The copies' own time: the slowest rank's fill, the runtime's load.
      assert.are.equal(0.002, report.timings.fill_copy)
      assert.are.equal(0.003, report.timings.load_copy)
    end)
  end)

  it("fills chunk k+1 while chunk k loads, and refills a buffer only after its load", function()
    async.run_async(function()
      local ranks, rollout, log = stand_ins({ delay = 20 })
      new(plan_of(4), ranks, rollout):run()
      local at = {}
      for index, line in ipairs(log) do
        local kind, k = line:match("^(%a+)#%d+ chunk (%d+)")
        if kind then
          at["start " .. kind .. " " .. k] = index
        end
        local ended = line:match("^end (%a+ %d+)$")
        if ended then
          at["end " .. ended] = index
        end
      end
      for k = 1, 4 do
        assert.is_true(at["start load " .. k] > at["end fill " .. k], "chunk " .. k .. " loaded before it filled")
      end
      for k = 1, 3 do
        -- Overlap: the next chunk fills while this one loads.
        assert.is_true(at["start fill " .. (k + 1)] < at["end load " .. k], "no overlap at chunk " .. k)
      end
      for k = 1, 2 do
        -- A buffer is refilled (chunk k + 2) only after its load ended.
        assert.is_true(at["start fill " .. (k + 2)] > at["end load " .. k], "buffer of chunk " .. k .. " refilled "
          .. "before its load ended")
      end
    end)
  end)

  it("with serial, fills chunk k+1 only after chunk k loaded, and says that no phases overlap", function()
    async.run_async(function()
      local ranks, rollout, log = stand_ins({ delay = 5 })
      local report = new(plan_of(3), ranks, rollout, nil, { serial = true }):run()
      local moves = {}
      for _, line in ipairs(log) do
        local kind, k = line:match("^(%a+)#%d+ chunk (%d+)")
        if kind then
          moves[#moves + 1] = "start " .. kind .. " " .. k
        elseif line:match("^end %a+ %d+$") then
          moves[#moves + 1] = line
        end
      end
      assert.are.same({ "start fill 1", "end fill 1", "start load 1", "end load 1", "start fill 2", "end fill 2",
        "start load 2", "end load 2", "start fill 3", "end fill 3", "start load 3", "end load 3" }, moves)
      assert.are.same({}, report.overlaps)
      assert.is_nil(report.trace) -- (none kept unless asked for)
    end)
  end)

  it("with trace, keeps each chunk's fill and load times in its report, and only its own", function()
    async.run_async(function()
      local ranks, rollout = stand_ins()
      local traced = new(plan_of(2), ranks, rollout, nil, { trace = true }):run()
      local plain_ranks, plain_rollout = stand_ins()
      local plain = new(plan_of(2), plain_ranks, plain_rollout):run()
      assert.are.equal(2, #traced.trace)
      for k = 1, 2 do
        assert.are.equal(0.002, traced.trace[k].fill[3]) -- (the slowest rank's copy)
        assert.are.equal(0.003, traced.trace[k].load[3])
      end
      assert.is_nil(plain.trace)
      assert.are_not.same({}, plain.overlaps)
    end)
  end)

  it("loads no chunk whose fill failed (the consensus gate), and poisons", function()
    async.run_async(function()
      local ranks, rollout, log = stand_ins({ fail = "fill#2" })
      local versions = versions_module.new()
      local publication = new(plan_of(3, 1), ranks, rollout, versions)
      local ok, err = pcall(publication.run, publication)
      assert.is_false(ok)
      assert.are.equal("PUBLISH_FAILED", err.code)
      assert.are.equal("chunks", err.phase)
      assert.matches("publication of model version 1 failed in chunks: injected fill#2", err.message, 1, true)
      for _, line in ipairs(log) do
        assert.is_nil(line:match("^load#2"), "chunk 2 was loaded after its fill failed")
      end
      assert.is_not_nil(rollout.destroyed, "not poisoned")
      assert.are.equal(0, versions.committed)
      -- The number is burned: the next publication gets 2.
      assert.are.equal(2, versions:next())
    end)
  end)

  it("starts the publication on every rank with its first fill, and sends no begin of its own", function()
    async.run_async(function()
      local ranks, rollout, log, seen = stand_ins()
      local publication = new(plan_of(3), ranks, rollout)
      publication:run()
      assert.are.same({ family = "qwen3_moe", publication_id = publication.header.publication_id }, seen.begins[1])
      assert.are.same({ false, false }, { seen.begins[2], seen.begins[3] })
      for _, line in ipairs(log) do
        assert.is_nil(line:match("^begin"), line)
      end
    end)
  end)

  it("has the runtime's start_update answered while chunk 1 fills, and loads no chunk before it is", function()
    async.run_async(function()
      local ranks, rollout, log = stand_ins({ delay = 10, start_delay = 60 })
      local report = new(plan_of(2), ranks, rollout):run()
      local at = {}
      for index, line in ipairs(log) do
        at[line] = at[line] or index
      end
      assert.is_true(at["end fill 1"] < at["end start_update"], "chunk 1 did not fill while the runtime started")
      assert.is_true(at["load#1 chunk 1 buffer 1"] > at["end start_update"], "chunk 1 loaded before the start")
      assert.is_true(report.timings.start >= 0.05, "start's time is not start_update's round trip")
      assert.are.same({ "start", "fill" }, report.overlaps[#report.overlaps].phases)
    end)
  end)

  it("poisons as start's when the start_update answered while chunk 1 fills failed; nothing loads", function()
    async.run_async(function()
      local ranks, rollout, log = stand_ins({ delay = 5, fail = "start_update#1" })
      local versions = versions_module.new()
      local publication = new(plan_of(2), ranks, rollout, versions)
      local ok, err = pcall(publication.run, publication)
      assert.is_false(ok)
      assert.are.equal("PUBLISH_FAILED", err.code)
      assert.are.equal("start", err.phase)
      assert.matches("publication of model version 1 failed in start: injected start_update#1", err.message, 1, true)
      for _, line in ipairs(log) do
        assert.is_nil(line:match("^load#"), "a chunk was loaded after start_update failed")
      end
      assert.is_not_nil(rollout.destroyed, "not poisoned")
      assert.are.equal(0, versions.committed)
    end)
  end)

  it("asks for release when the runtime's finish answer does not say it released", function()
    async.run_async(function()
      local ranks, rollout, log = stand_ins({ keeps_release = true })
      assert.are.equal(1, new(plan_of(1), ranks, rollout):run().model_version)
      assert.are.same({ "finish_update#1", "release#1" }, { log[#log - 1], log[#log] })
    end)
  end)

  it("verifies the manifests the last fill's answers bring, before the last chunk loads; one that differs poisons "
    .. "as verify's", function()
    async.run_async(function()
      local ranks, rollout, log, seen = stand_ins({ delay = 50, fill_delay = 5, exported = string.rep("cd", 32) })
      local versions = versions_module.new()
      local publication = new(plan_of(2), ranks, rollout, versions)
      local ok, err = pcall(publication.run, publication)
      assert.is_false(ok)
      assert.are.equal("PUBLISH_FAILED", err.code)
      assert.are.equal("verify", err.phase)
      assert.are.equal("VERIFY_FAILED", err.cause)
      assert.are.equal(1, err.rank)
      assert.matches("failed in verify: trainer rank 1 exported manifest cdcd", err.message, 1, true)
      assert.are.same({ false, true }, seen.verifies)
      for _, line in ipairs(log) do
        assert.is_nil(line:match("^verify"), "the ranks were asked for their manifests again")
        assert.is_nil(line:match("^load#2"), "the last chunk loaded before its manifests were checked")
      end
      assert.is_not_nil(rollout.destroyed, "not poisoned")
      assert.are.equal(0, versions.committed)
    end)
  end)

  it("fails verify when a rank answers the last fill without its consumed manifest", function()
    async.run_async(function()
      local ranks, rollout = stand_ins({ no_consumed = true })
      local publication = new(plan_of(2), ranks, rollout)
      local ok, err = pcall(publication.run, publication)
      assert.is_false(ok)
      assert.are.equal("verify", err.phase)
      assert.are.equal(1, err.rank)
      assert.matches("trainer rank 1 answered the last fill without its consumed manifest", err.message, 1, true)
    end)
  end)

  it("on the direct path, loads a chunk without waiting for its fill (which moves nothing), once the first fill "
    .. "began the publication", function()
    async.run_async(function()
      local ranks, rollout, log = stand_ins({ delay = 5, fill_delay = 40 })
      local plan = plan_of(3, 4)
      plan.direct = true
      function ranks:direct_tensors()
        return {}
      end
      new(plan, ranks, rollout):run()
      local at = {}
      for index, line in ipairs(log) do
        at[line:match("^(load#%d)") or line] = index
      end
      assert.is_true(at["load#1"] > at["end fill 1"], "a load read the storage before the ranks began")
      assert.is_true(at["load#2"] < at["end fill 2"], "the load waited for its fill")
    end)
  end)

  describe("with chunks ordered on the device", function()
    local function ordered_plan(chunks)
      local plan = plan_of(chunks, 1) -- (one buffer: the device orders its reuse)
      plan.ordered, plan.gated = true, true
      return plan
    end

    it("queues each fill with the numbers it waits for and writes, each load once its fill is queued, and waits "
      .. "only for the last", function()
      async.run_async(function()
        local ranks, rollout, log, gates = stand_ins({ delay = 5 })
        local versions = versions_module.new()
        local plan = ordered_plan(3)
        new(plan, ranks, rollout, versions):run()
        new(plan, ranks, rollout, versions):run()
        assert.are.same({ { seq = 1 }, { after = 1, seq = 2 }, { after = 2, seq = 3 },
          { seq = 4 }, { after = 4, seq = 5 }, { after = 5, seq = 6 } }, gates.fills)
        assert.are.same({ { seq = 1, last = false }, { seq = 2, last = false }, { seq = 3, last = true },
          { seq = 4, last = false }, { seq = 5, last = false }, { seq = 6, last = true } }, gates.loads)
        for _, line in ipairs(log) do
          assert.is_nil(line:match("buffer 2"), line)
        end
        local at = {}
        for index, line in ipairs(log) do
          at[line:match("^(%a+#%d+)") or line] = at[line:match("^(%a+#%d+)") or line] or index
        end
        for k = 1, 3 do
          assert.is_true(at["load#" .. k] > at["end fill " .. k], "load " .. k .. " asked before its fill answered")
        end
        -- (The fills do not wait for the loads, one buffer as it is: the
        -- device orders them.)
        assert.is_true(at["fill#2"] < at["end load 1"], "fill 2 waited for load 1")
        assert.is_true(at["verify#1"] > at["end load 3"], "verified before the last load ended")
        assert.are.equal(2, versions.committed)
      end)
    end)

    it("orders them on the host with buffers.order = \"auto\" when the runtime's workers cannot wait on the device",
      function()
        async.run_async(function()
          local ranks, rollout, _, gates = stand_ins({ unordered_runtime = true })
          local plan = ordered_plan(2)
          plan.ordered = nil -- ("auto": gated, not required)
          assert.are.equal(1, new(plan, ranks, rollout):run().model_version)
          assert.are.same({ false, false }, gates.fills)
          assert.are.same({ false, false }, gates.loads)
        end)
      end)

    it("is refused at init, before anything moved, by a runtime whose workers cannot wait on the device", function()
      async.run_async(function()
        local ranks, rollout, log = stand_ins({ unordered_runtime = true })
        local publication = new(ordered_plan(2), ranks, rollout)
        local ok, err = pcall(publication.run, publication)
        assert.is_false(ok)
        assert.are.equal("PREFLIGHT", err.code)
        assert.are.equal("init", err.phase)
        assert.matches('buffers.order = "device" needs a runtime whose TP workers wait on the device', err.message,
          1, true)
        assert.is_nil(rollout.destroyed)
        for _, line in ipairs(log) do
          assert.is_nil(line:match("^fill") or line:match("^start_update"), line)
        end
      end)
    end)

    it("destroys the runtime at once when a fill fails, so that no load waits on the device for it", function()
      async.run_async(function()
        local ranks, rollout, log = stand_ins({ fail = "fill#2", delay = 5 })
        local versions = versions_module.new()
        local publication = new(ordered_plan(3), ranks, rollout, versions)
        local ok, err = pcall(publication.run, publication)
        assert.is_false(ok)
        assert.are.equal("PUBLISH_FAILED", err.code)
        assert.are.equal("chunks", err.phase)
        assert.matches("injected fill#2", err.message, 1, true)
        for _, line in ipairs(log) do
          assert.is_nil(line:match("^load#2"), "chunk 2 was loaded after its fill failed")
        end
        assert.is_not_nil(rollout.destroyed)
        assert.are.equal(0, versions.committed)
      end)
    end)
  end)

  it("does not poison when the preflight fails (nothing moved)", function()
    async.run_async(function()
      local ranks, rollout = stand_ins({ fail = "check_registration" })
      local publication = new(plan_of(1), ranks, rollout)
      local ok, err = pcall(publication.run, publication)
      assert.is_false(ok)
      assert.are.equal("preflight", err.phase)
      assert.is_nil(rollout.destroyed)
    end)
  end)

  it("refuses a phase out of order without harming the publication", function()
    async.run_async(function()
      local ranks, rollout, log = stand_ins()
      local publication = new(plan_of(2), ranks, rollout)
      local ok, err = pcall(publication.start, publication)
      assert.is_false(ok)
      assert.are.equal("PHASE_ORDER", err.code)
      assert.are.same({}, log)
      publication:preflight()
      publication:init()
      publication:start()
      publication:chunk()
      ok, err = pcall(publication.verify, publication)
      assert.is_false(ok)
      assert.are.equal("PHASE_ORDER", err.code)
      assert.matches("every chunk moved first (1 of 2 moved)", err.message, 1, true)
      publication:chunk()
      publication:verify()
      publication:finish()
      assert.are.equal(1, publication:release().model_version)
      assert.is_nil(rollout.destroyed)
    end)
  end)

  it("poisons when the runtime commits another version than the header's", function()
    async.run_async(function()
      local ranks, rollout = stand_ins({ committed = 7 })
      local publication = new(plan_of(1), ranks, rollout)
      local ok, err = pcall(publication.run, publication)
      assert.is_false(ok)
      assert.are.equal("finish", err.phase)
      assert.are.equal("RECEIPT_INVALID", err.cause)
      assert.is_not_nil(rollout.destroyed)
    end)
  end)
end)
