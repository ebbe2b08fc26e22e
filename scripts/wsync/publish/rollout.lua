--- One spawned rollout runtime, as a session owns it: its client (the
--- control channel and the process tree), what it said about itself at
--- startup, whether its weights were initialized (its TP workers imported the
--- packed buffers and sized their resident storage), which chunks' tensor
--- metadata it has, and whether a failed publication destroyed it. A session
--- that respawns makes a new one; a destroyed one is never used again.
local errors = require("wsync.errors")
local plan_module = require("wsync.plan")
local runtime_module = require("wsync.runtime")

local M = {}

---@class wsync.Rollout
---@field client wsync.RuntimeClient
---@field info table            the runtime's answer to `info` at startup
---@field initialized boolean   init_weights done
---@field poisoned wsync.Error? why a failed publication destroyed it
local Rollout = {}
Rollout.__index = Rollout

--- Spawns a runtime (wsync.runtime.spawn's options) and asks for its info.
--- Raises RUNTIME_START when it does not start.
---@param options table
---@return wsync.Rollout
function M.spawn(options)
  local client = runtime_module.spawn(options)
  local self = setmetatable({ client = client, initialized = false, chunks_sent = {} }, Rollout)
  self.info = client:info()
  return self
end

--- Sends a command and returns its result (wsync.control.client's rules:
--- a failed weight, sleep or wake command breaks it).
---@param cmd string
---@param payload table?
function Rollout:request(cmd, payload)
  return self.client:request(cmd, payload or {})
end

--- The TP workers' startup info, by TP rank (1-based).
function Rollout:workers()
  return self.info.workers
end

--- Initializes the workers' weights once per runtime: each worker maps its
--- rank's packed buffers (`descriptors[rank + 1]`, of `transport`) and sizes
--- its resident storage to its loader plan.
---@param plan wsync.Plan
---@param tp integer
---@param transport string
---@param descriptors string[][]
function Rollout:init_weights(plan, tp, transport, descriptors)
  if self.initialized then
    return
  end
  self:request("init_weights", { family = plan.family, config = plan.config, tp = tp, transport = transport,
    buffers = descriptors })
  self.initialized = true
  self.chunks_sent = {}
end

--- The runtime loads chunk `k` from buffer slot `buffer`. A chunk's tensor
--- metadata goes to a runtime once after its init_weights: its TP workers
--- plan the chunk's loads then and keep the plan by chunk number, so later
--- publications send no per-tensor JSON. A worker asked to load a chunk whose
--- metadata it never got fails the publication.
---@param plan wsync.Plan
---@param k integer
---@param buffer integer
function Rollout:load_chunk(plan, k, buffer, tensors)
  local payload = { chunk = k, buffer = buffer }
  if not self.chunks_sent[k] then
    payload.tensors = tensors or plan.chunks[k].tensors
  end
  local answer = self:request("load_chunk", payload)
  self.chunks_sent[k] = true
  return answer
end

--- The resident tensor count of every TP rank (the header's
--- `resident_tensors`), from the plan: computed once per plan and TP size.
---@param plan wsync.Plan
---@param tp integer
---@return integer[]
function M.resident_counts(plan, tp)
  plan.resident_counts = plan.resident_counts or {}
  if not plan.resident_counts[tp] then
    local family = plan_module.family(plan.family)
    local counts = {}
    for rank = 0, tp - 1 do
      counts[rank + 1] = #family.loader_plan(plan.config, tp, rank).tensors
    end
    plan.resident_counts[tp] = counts
  end
  return plan.resident_counts[tp]
end

--- Destroys the runtime's process tree after a failed publication (fail
--- stop: a partly loaded runtime is never used again) and waits until it is
--- gone.
---@param cause any
function Rollout:destroy(cause)
  self.poisoned = self.poisoned or cause
  if self.client.state ~= "CLOSED" then
    self.client:destroy("poisoned: " .. (errors.is(cause) and cause.message or tostring(cause)))
    self.client:wait_dead()
  end
  self.initialized = false
end

--- Ends the runtime: shut down politely when it is idle, destroyed when a
--- request is still in flight (a REPL chunk abandoned mid-publication: its
--- state is unknown). Waits until the tree is gone.
function Rollout:close()
  local client = self.client
  if client.state == "INFLIGHT" then
    client:destroy("the session closed with " .. tostring(client.inflight.pending and client.inflight.pending.cmd)
      .. " in flight")
  end
  if client.state ~= "CLOSED" then
    client:close()
  end
end

--- What `wsync repl --attach` shows of it.
function Rollout:state()
  return { state = self.client.state, pid = self.client.pid, workers = #self.info.workers }
end

return M
