--- The reference rollout runtime's main process (`wsync runtime`): spawns one
--- TP worker per rank in its own process group, answers the host over the
--- control channel, and fans commands out to the workers.
---
--- It holds vLLM-style TP-local resident weights in its workers, sleeps and
--- wakes them, and (with the publication protocol) receives weights. It
--- generates with a deterministic toy decoder (wsync.runtime.decoder), not a
--- language model: streaming requests, several in flight, each token stamped
--- with the version that produced it.
local uv = require("luv")
local client_module = require("wsync.control.client")
local errors = require("wsync.errors")
local fault_module = require("wsync.control.fault")
local loop = require("wsync.loop")
local process = require("wsync._process")
local protocol = require("wsync.control.protocol")
local contract = require("wsync.runtime.contract")
local server_module = require("wsync.control.server")
local util = require("wsync.util")

local M = {}

---@class wsync.ReferenceRuntime
local Runtime = {}
Runtime.__index = Runtime
M.Runtime = Runtime -- its methods, for tests

-- Runs `cmd` on every worker concurrently; returns the results by rank, or
-- raises a fatal error naming the first worker that failed.
function Runtime:broadcast(cmd, payload, payload_of)
  self:check_workers()
  local results, failed, err = loop.all(#self.workers, function(rank)
    return self.workers[rank]:request(cmd, payload_of and payload_of(rank) or payload)
  end)
  if failed then
    local fatal = err.code ~= "RUNTIME_COMMAND_FAILED"
    if fatal then
      self.broken, self.broken_rank = err.message, failed - 1
    end
    errors.raise(fatal and "WORKER_FAILED" or (err.remote_code or "WORKER_FAILED"), err.message,
      { fatal = fatal, rank = failed - 1 })
  end
  return results
end

-- Raises a fatal WORKER_DIED when a worker broke (died, hung, misbehaved),
-- even while the runtime was idle: a partial runtime is never used again.
function Runtime:check_workers()
  if not self.broken then
    for index, worker in ipairs(self.workers) do
      if worker.state == "BROKEN" then
        self.broken, self.broken_rank = worker.cause.message, index - 1
        break
      end
    end
  end
  if self.broken then
    errors.raise("WORKER_DIED", self.broken, { fatal = true, rank = self.broken_rank })
  end
end

-- A header must match this runtime (wsync.runtime.contract.check_header):
-- its protocol, transport, committed version, TP world and the workers'
-- devices in order.
function Runtime:check_header(header)
  local uuids = {}
  for rank, info in ipairs(self.worker_info) do
    uuids[rank] = info.device.uuid
  end
  contract.check_header(header, { protocol = protocol.VERSION, transport = self.transport,
    committed = self.model_version or 0, tp_world = #self.workers, uuids = uuids })
  self.expected_resident = header.resident_tensors
end

--- Computes the digest of the weights the workers hold now (every worker's
--- weights_digest), which the toy decoder generates from, when they are
--- awake and none is known.
function Runtime:refresh_digest()
  local state = self:state()
  if self.weights_digest or state.weights ~= "awake" then
    return
  end
  local parts = {}
  for rank, result in ipairs(self:broadcast("weights_digest", {})) do
    parts[rank] = result.digest
  end
  self.weights_digest = require("wsync.native.digest").sha256_hex(table.concat(parts, "|"))
end

--- The weights changed (a commit, a wake): the digest is asked again when
--- generation next needs it, at once only while requests stream unpaused
--- (the decoder's steps read it), so that a runtime that does not generate
--- pays nothing for it in a publication.
function Runtime:forget_digest()
  self.weights_digest = nil
  if self.decoder:in_flight() > 0 and not self.decoder:pause_state() then
    self:refresh_digest()
  end
end

--- Whether generation may run now: weights awake, the KV cache reserved, no
--- update between start and finish, nothing broken (the decoder's steps ask).
function Runtime:may_generate()
  local state = self:state()
  return not self.update and not self.broken and state.weights == "awake" and state.kv_cache == "reserved"
    and self.weights_digest ~= nil
end

--- Refuses generation that cannot run now, naming why (STATE_REFUSED: the
--- runtime stays usable).
function Runtime:ready_to_generate(held)
  self:check_workers()
  local paused = self.decoder:pause_state()
  if paused and not held then
    errors.raise("STATE_REFUSED", string.format("generation is paused (%s): resume first", paused.mode))
  end
  if self.update then
    errors.raise("STATE_REFUSED", string.format("no generation during a weight update (publication %s is between "
      .. "start and finish)", tostring(self.update.publication_id)))
  end
  local state = self:state()
  if state.weights ~= "awake" or state.kv_cache ~= "reserved" then
    errors.raise("STATE_REFUSED", string.format("generation needs the weights awake and the KV cache reserved; "
      .. "weights are %s, the KV cache is %s", tostring(state.weights), tostring(state.kv_cache)))
  end
  self:refresh_digest()
end

-- The payload of a load_chunk to the workers: the first of an update brings
-- the update's start (`start`, start_update's payload), once.
function Runtime:with_start(payload)
  local start = self.workers_start
  if not start then
    return payload
  end
  self.workers_start = nil
  return util.merged(payload, { start = start })
end

function Runtime:state()
  local first = self.worker_state[1] or {}
  return { weights = first.weights, kv_cache = first.kv_cache }
end

function Runtime:remember(results)
  for rank, result in ipairs(results) do
    self.worker_info[rank] = result
    self.worker_state[rank] = result.state
  end
end

function Runtime:info()
  local workers = {}
  for rank, info in ipairs(self.worker_info) do
    workers[rank] = {
      rank = info.rank, pid = info.pid, device = info.device, state = self.worker_state[rank],
      memory = info.memory,
    }
  end
  return {
    protocol = protocol.VERSION,
    runtime = "reference",
    version = require("wsync").version,
    pid = uv.os_getpid(),
    tp_world = #self.workers,
    backend = self.backend,
    capabilities = { generate = "toy decoder", sleep_levels = { 1, 2 }, wake_tags = { "weights", "kv_cache" } },
    generation = { in_flight = self.decoder and self.decoder:in_flight() or 0,
      paused = self.decoder and self.decoder:pause_state() and self.decoder:pause_state().mode or nil },
    state = self:state(),
    workers = workers,
    model_version = self.model_version,
    updating = self.update ~= nil,
    prefix_cache_resets = self.prefix_cache_resets or 0,
  }
end

function Runtime:handlers()
  return {
    info = function()
      self:check_workers()
      return self:info()
    end,
    sleep = function(payload)
      if self.update then
        -- (The workers start the update only at its first load.)
        errors.raise("STATE_REFUSED", "cannot sleep during a weight update")
      end
      self:remember(self:broadcast("sleep", { level = payload.level }))
      self.weights_digest = nil
      return self:info()
    end,
    wake = function(payload)
      self:remember(self:broadcast("wake", { tags = payload.tags }))
      self:forget_digest() -- (woken weights are new bytes)
      return self:info()
    end,
    checksum = function()
      return { workers = self:broadcast("checksum", {}) }
    end,
    -- Generation (wsync.runtime.decoder): `generate` waits for its outputs,
    -- `submit` and `poll` stream.
    generate = function(payload)
      self:ready_to_generate()
      local prompts = payload.prompts
      if prompts == nil or (type(prompts) == "table" and next(prompts) == nil) then
        return { model_version = self.model_version or 0, outputs = {} }
      end
      local sampling = type(payload.sampling) == "table" and payload.sampling or {}
      local version = self.model_version or 0
      local outputs = self.decoder:generate(prompts, sampling.max_tokens or 16)
      return { model_version = version, outputs = outputs }
    end,
    submit = function(payload)
      self:ready_to_generate(true) -- (while paused: held until resume)
      return { ids = self.decoder:submit(payload.requests) }
    end,
    pause = function(payload)
      self:check_workers()
      return self.decoder:pause(payload.mode, payload.kv)
    end,
    resume = function()
      self:check_workers()
      self:refresh_digest() -- (a publication while paused changed the weights)
      return self.decoder:resume()
    end,
    poll = function(payload)
      self:check_workers()
      return { requests = self.decoder:poll(payload.ids), in_flight = self.decoder:in_flight() }
    end,
    shutdown = function()
      self.decoder:close()
      local failures = self:close_workers()
      if #failures > 0 then
        -- (The host destroys this process's group when it hears this.)
        -- A worker that did not shut down cleanly was destroyed; the host
        -- learns which one, and why.
        errors.raise("WORKER_FAILED", failures[1].message, { fatal = true, rank = failures[1].rank })
      end
      self.server.after_answer = function()
        self.server:close_after_flush()
      end
      return {}
    end,
    init_weights = function(payload)
      local results = self:broadcast("init_weights", nil, function(rank)
        return {
          family = payload.family, config = payload.config, tp = payload.tp,
          transport = payload.transport, buffers = payload.buffers[rank],
          gate = payload.gates and payload.gates[rank] or nil, quantization = payload.quantization,
        }
      end)
      self.initialized, self.transport = true, payload.transport
      self.decoder.vocab = type(payload.config) == "table" and payload.config.vocab_size or self.decoder.vocab
      self.weights_digest = nil
      -- (`ordered`: every worker mapped its rank's gate, so chunks may be
      -- ordered on the device.)
      local ordered = payload.gates ~= nil
      for _, result in ipairs(results) do
        ordered = ordered and result.ordered == true
      end
      return { workers = results, ordered = ordered }
    end,
    -- The workers start the update with its first load_chunk (`start`: this
    -- command's payload), not at once: their own start is one hop less per
    -- publication. What they would refuse at start (weights not awake) is
    -- refused here already, as the workers' state says.
    start_update = function(payload)
      self:check_workers()
      self:check_header(payload.header)
      for rank, state in ipairs(self.worker_state) do
        if type(state) ~= "table" or state.weights ~= "awake" then
          errors.raise("STATE_REFUSED", string.format("cannot update weights that are %s (TP worker %d): wake "
            .. "weights first", tostring(type(state) == "table" and state.weights), rank - 1), { rank = rank - 1 })
        end
      end
      self.update, self.workers_start, self.receipts = payload.header, payload, nil
      return {}
    end,
    load_chunk = function(payload)
      if not self.update then
        errors.raise("NOT_UPDATING", "load_chunk outside an update", { fatal = true })
      end
      local sent = self:with_start(payload)
      if payload.last == true then
        -- (The update's last chunk: each worker ends its update with it and
        -- answers its receipt, which finish_update checks and commits.)
        sent = util.merged(sent, { finish = { publication_id = self.update.publication_id,
          model_version = self.update.model_version } })
      end
      local results = self:broadcast("load_chunk", sent)
      if payload.last == true then
        self.receipts = {}
        for rank, result in ipairs(results) do
          self.receipts[rank] = result.receipt
        end
      end
      local bytes, copy_seconds = 0, 0
      for _, result in ipairs(results) do
        bytes = bytes + result.bytes
        copy_seconds = math.max(copy_seconds, tonumber(result.copy_seconds) or 0)
      end
      -- (copy_seconds: the slowest worker's copy; they load at once.)
      return { chunk = payload.chunk, bytes = bytes, copy_seconds = copy_seconds }
    end,
    finish_update = function(payload)
      local header = self.update
      if not header then
        errors.raise("NOT_UPDATING", "finish_update without start_update", { fatal = true })
      end
      local receipts = self.receipts
      self.receipts = nil
      if receipts then
        -- (Made with the last load: the request must name the publication
        -- the workers updated, as each worker checks at its own finish, and
        -- no worker may have broken since.)
        self:check_workers()
        if payload.publication_id ~= header.publication_id or payload.model_version ~= header.model_version then
          errors.raise("WRONG_PUBLICATION", string.format("finish_update for publication %s version %s; the workers "
            .. "updated publication %s version %s", tostring(payload.publication_id),
            tostring(payload.model_version), tostring(header.publication_id), tostring(header.model_version)),
            { fatal = true })
        end
      else
        if self.workers_start then
          self:broadcast("start_update", self.workers_start) -- (an update without a load)
          self.workers_start = nil
        end
        receipts = self:broadcast("finish_update", payload)
      end
      self.update = nil
      contract.check_receipts(header, receipts, self.expected_resident)
      -- Commit: the version is served from now on; cached prefixes computed
      -- with the old weights are dropped.
      self.model_version = header.model_version
      self.prefix_cache_resets = (self.prefix_cache_resets or 0) + 1
      -- The decoder's weights are the new ones from the next token on.
      self:forget_digest()
      -- (`release`: the buffer policy's release in the same answer. The
      -- workers read no buffer outside an update, and the buffers stay
      -- mapped: "keep".)
      return { model_version = self.model_version, receipts = receipts, prefix_cache_reset = true,
        released = payload.release == true or nil }
    end,
    release = function(payload)
      if self.update then
        errors.raise("STATE_REFUSED", "release during an update", { fatal = true })
      end
      return { workers = self:broadcast("release", payload) }
    end,
    resident_checksums = function()
      return { workers = self:broadcast("resident_checksums", {}) }
    end,
    resident_check = function(payload)
      return { workers = self:broadcast("resident_check", { step = payload.step }) }
    end,
    resident_values = function()
      return { workers = self:broadcast("resident_values", {}) }
    end,
    -- Memory of every process of the runtime (soak tests watch it stay flat).
    process_memory = function()
      return { main = util.memory_usage(), workers = self:broadcast("process_memory", {}) }
    end,
  }
end

-- Shuts every worker down at once and waits until all are gone, except a
-- worker that broke: its failure is known at once and its process is
-- destroyed meanwhile (the host destroys this whole group when it hears of
-- the failure). Returns the failures ({rank,
-- message}, by rank), empty when every worker closed cleanly.
function Runtime:close_workers()
  local workers = self.workers
  -- Each worker's failure as text (false when it closed cleanly).
  local outcomes = loop.all(#workers, function(index)
    local ok, closed, cause = pcall(workers[index].close, workers[index], { wait = false })
    if not ok then
      return tostring(closed)
    end
    return not closed and cause.message
  end)
  local failures = {}
  for index = 1, #workers do
    if outcomes[index] then
      failures[#failures + 1] = { rank = index - 1, message = outcomes[index] }
    end
  end
  return failures
end

-- Destroys every worker that is not closed (the host is gone).
function Runtime:destroy_workers(reason)
  for _, worker in pairs(self.workers) do
    if worker.state ~= "CLOSED" then
      worker:destroy(reason)
    end
  end
end


-- Spawns every TP worker at once, each with the handshake timeout of this
-- process's own hop to it. Returns nil, or the first failure (the workers
-- that did start are destroyed and reaped first).
function Runtime:start_workers(options, faults)
  local timeouts = client_module.inner_timeouts(options.timeouts)
  local results, failed, err = loop.all(options.tp, function(index)
    local rank = index - 1
    -- Each worker gets only its own faults, never the main process's.
    local worker = client_module.spawn({
      name = "TP worker " .. rank,
      name_pid = true,
      detached = false,
      timeouts = timeouts,
      grace_ms = options.grace_ms,
      env = { "WSYNC_RUNTIME_FAULT=" .. (faults.workers[rank] or "") },
      argv = {
        options.program, "runtime-worker",
        "--rank", tostring(rank), "--world", tostring(options.tp),
        "--backend", options.backend, "--device", tostring(options.devices[index]),
        "--weights-bytes", tostring(options.weights_bytes), "--kv-bytes", tostring(options.kv_bytes),
      },
    })
    self.workers[index] = worker
    return worker
  end)
  if failed then
    for index = 1, options.tp do
      if results[index] then
        results[index]:destroy("another TP worker did not start")
        results[index]:wait_dead()
      end
    end
    self.workers = {}
    -- (The client's message names the worker, its pid and the cause.)
    return errors.new("RUNTIME_START", errors.is(err) and err.message or tostring(err),
      { rank = failed - 1, fatal = true })
  end
  for index, worker in ipairs(results) do
    self.worker_info[index] = worker.startup_info
    self.worker_state[index] = worker.startup_info.state
  end
  return nil
end

---@class wsync.ReferenceRuntimeOptions
---@field tp integer
---@field backend string
---@field devices integer[]
---@field weights_bytes integer
---@field kv_bytes integer
---@field timeouts table<string, number>
---@field fault string?
---@field program string
---@field grace_ms integer?

--- Runs the main process: serves the host at once, spawns the workers, and
--- answers the host's startup handshake (`info`) once every worker answered
--- its own, or with the worker that did not. `timeouts` are the host's, by
--- command; this process's hop to its workers uses a little less of each.
---@param options wsync.ReferenceRuntimeOptions
function M.main(options)
  -- The host's channel must be served before any worker is spawned: a
  -- worker's pipe would otherwise take the free fd 3.
  if uv.guess_handle(3) ~= "pipe" then
    errors.raise("RUNTIME_START", "reference runtime: no control channel on fd 3 "
      .. "(the host starts `wsync runtime` through wsync.runtime.spawn)")
  end
  -- Die with the process that started this one; refuse to run on when it
  -- is already gone (nobody would ever stop this process).
  local parent_ok, parent_gone = process.die_with_parent("SIGKILL", tonumber(os.getenv("WSYNC_PARENT_PID")))
  if not parent_ok then
    errors.raise("RUNTIME_START", "the process that started this one is gone: " .. tostring(parent_gone))
  end
  local faults = fault_module.parse(options.fault)
  options.timeouts = require("wsync.control.timeouts").with(options.timeouts)
  local self = setmetatable({
    backend = options.backend,
    workers = {},
    worker_info = {},
    worker_state = {},
  }, Runtime)
  self.decoder = require("wsync.runtime.decoder").new({
    step_ms = tonumber(os.getenv("WSYNC_DECODER_STEP_MS") or "") or 1,
    allowed = function()
      return self:may_generate()
    end,
    version = function()
      return self.model_version or 0
    end,
    weights = function()
      return self.weights_digest or ""
    end,
  })
  local handlers = self:handlers()
  -- Until the workers are up, `info` waits for them (the host's handshake).
  local started, startup_failure, waiting = false, nil, {}
  local info = handlers.info
  handlers.info = function(payload)
    if not started then
      loop.await(function(resume)
        waiting[#waiting + 1] = resume
      end)
    end
    if startup_failure then
      error(startup_failure, 0)
    end
    return info(payload)
  end
  self.server = server_module.serve({
    name = "reference runtime",
    handlers = handlers,
    fault = faults,
    on_close = function()
      -- The host went away (or broke the connection): take the workers down.
      self.host_gone = true
      self:destroy_workers("the host closed the control channel")
    end,
  })
  startup_failure = self:start_workers(options, faults)
  if self.host_gone then -- while the workers started
    self:destroy_workers("the host closed the control channel")
  end
  started = true
  for _, resume in ipairs(waiting) do
    resume()
  end
  return self
end

return M
