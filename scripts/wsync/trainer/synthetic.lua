--- The synthetic trainer (`wsync trainer`): an agent with generated weights,
--- for the demo, tests and benchmarks. It holds one FSDP rank of a model in
--- the transformers-v5 trainer layout (packed experts, every tensor sharded on
--- dim 0 as torch.chunk splits it, uneven splits included). Its values are
--- wsync's synthetic values of (tensor name, element index, version); an
--- "optimizer step" moves every shard to the next version's values.
---
--- Memory callbacks (offload/onload of optimizer and actor) track state and
--- refuse steps that make no sense (publishing an offloaded actor).
---
--- Test-only faults ($WSYNC_TRAINER_FAULT, comma-separated, each optionally
--- prefixed `rank<R>:` to apply to one rank only): `die@CMD#N` (SIGKILL
--- itself at the N-th host command CMD: fill, begin, verify, callback, ...),
--- `stop@CMD#N` (SIGSTOP itself there: a rank that stops answering;
--- `stop@publish#N` and `die@publish#N` act before the N-th publish),
--- `fail@CMD#N` (answer it with an error), `drop_expert`
--- (register the packed experts without the last expert), `wrong_device`
--- (report the next rank's device), `stale@publish#N` (skip the optimizer
--- step before the N-th publish: that publish carries the previous version's
--- values; structurally nothing differs, so only the host's resident check,
--- a recipe's `verify`, can catch it).
---
--- A failed publication ends the trainer with its error, unless the host says
--- it respawns the runtime (`respawn` on the error): then the rank reports the
--- failure on stderr and goes on to its next step.
local uv = require("luv")
local agent_module = require("wsync.trainer.agent")
local errors = require("wsync.errors")
local plan_module = require("wsync.plan")
local synth = require("wsync.native.synth")
local transport_module = require("wsync.transport")

local M = {}

-- $WSYNC_TRAINER_FAULT's items for this rank (wsync.control.fault.items):
-- a list of {kind, cmd, nth} and the flags set by name.
local function parse_faults(spec, rank)
  local faults = {}
  local items = require("wsync.control.fault").items(spec, { flags = { drop_expert = true, wrong_device = true },
    prefix = "rank", what = "trainer fault" })
  for _, item in ipairs(items) do
    if item.target == nil or item.target == rank then
      if item.flag then
        faults[item.flag] = true
      else
        faults[#faults + 1] = { kind = item.kind, cmd = item.cmd, nth = item.nth or 1, seen = 0 }
      end
    end
  end
  return faults
end

--- The shards of one rank: `{tensors = {{name, dtype, shape, rows, offset,
--- bytes, row_elements}}, bytes}` laid out back to back in one memory.
---@param layout table[]  trainer tensors
---@param world integer
---@param rank integer
---@param shard_rows fun(rows: integer, world: integer, rank: integer): integer, integer
function M.shards(layout, world, rank, shard_rows)
  local shards = { tensors = {}, bytes = 0 }
  for _, tensor in ipairs(layout) do
    local first, count = shard_rows(tensor.shape[1], world, rank)
    local row_elements = 1
    for i = 2, #tensor.shape do
      row_elements = row_elements * tensor.shape[i]
    end
    local bytes = count * row_elements * 2
    shards.tensors[#shards.tensors + 1] = {
      name = tensor.name, dtype = tensor.dtype, shape = tensor.shape, rows = { first, count },
      offset = shards.bytes, bytes = bytes, row_elements = row_elements,
    }
    shards.bytes = shards.bytes + bytes
  end
  return shards
end

--- Places the shards in memory from `allocate(bytes, what)`: "one"
--- allocation holding them all back to back (as M.shards lays them out), or
--- one allocation per "tensor" (as a PyTorch trainer's caching allocator
--- gives each large tensor a segment of its own). Sets each shard's `memory`,
--- `region` (its index in `shards.memories`) and `offset` in it.
---@param shards table  M.shards' result
---@param storage "one"|"tensor"
---@param allocate fun(bytes: integer, what: string): any
function M.place(shards, storage, allocate)
  shards.memories = {}
  if storage == "tensor" then
    for index, shard in ipairs(shards.tensors) do
      shards.memories[index] = assert(allocate(shard.bytes, shard.name))
      shard.memory, shard.region, shard.offset = shards.memories[index], index, 0
    end
    return
  end
  shards.memories[1] = assert(allocate(shards.bytes, "the rank's shards"))
  for _, shard in ipairs(shards.tensors) do
    shard.memory, shard.region = shards.memories[1], 1
  end
end

--- Writes version `version`'s values into every shard (placed by M.place):
--- on the device where the transport can (one launch for all shards), else
--- on the host.
---@param shards table
---@param version integer
---@param transport table?  the backend's transport (wsync.transport)
function M.generate(shards, version, transport)
  if transport and transport_module.can(transport, "device_check") then
    if not shards.ops then
      shards.ops = {}
      for _, shard in ipairs(shards.tensors) do
        if shard.bytes > 0 then
          shards.ops[#shards.ops + 1] = { region = shard.region, name = shard.name, offset = shard.offset,
            elements = shard.rows[2] * shard.row_elements, first = shard.rows[1] * shard.row_elements }
        end
      end
    end
    assert(transport.fill_synthetic(shards.memories, shards.ops, version))
    return
  end
  for _, shard in ipairs(shards.tensors) do
    if shard.bytes > 0 then
      assert(synth.fill(shard.memory, shard.offset, shard.name, shard.rows[1] * shard.row_elements,
        shard.rows[2] * shard.row_elements, version))
    end
  end
end

---@class wsync.SyntheticTrainerOptions
---@field endpoint string
---@field rank integer
---@field world integer
---@field family string
---@field model string|table
---@field versions integer
---@field backend string?
---@field device_index integer?
---@field storage "one"|"tensor"?  how the shards are allocated (M.place; default "one")

--- Runs one synthetic trainer rank: connect, register, then for each version
--- an optimizer step and a collective publish.
---@param options wsync.SyntheticTrainerOptions
function M.main(options)
  local faults = parse_faults(os.getenv("WSYNC_TRAINER_FAULT"), options.rank)
  local family = plan_module.family(options.family or "qwen3_moe")
  local config = family.config(options.model)
  local layout = family.trainer_layout(config)
  if faults.drop_expert then
    for _, tensor in ipairs(layout) do
      if tensor.name:match("experts%.gate_up_proj$") then
        tensor.shape = { tensor.shape[1] - 1, tensor.shape[2], tensor.shape[3] }
      end
    end
  end
  local shards = M.shards(layout, options.world, options.rank, family.shard_rows)
  local device_index = options.device_index or options.rank
  local transport = transport_module.for_backend(options.backend or "host")
  -- The shards live on the rank's device (the host backend's is this
  -- process's memory).
  M.place(shards, options.storage or "one", function(bytes, what)
    return transport.allocate(bytes, what, { device = device_index })
  end)
  if faults.wrong_device then
    device_index = (options.rank + 1) % options.world
  end
  local agent = agent_module.connect({
    endpoint = options.endpoint, rank = options.rank, world = options.world,
    backend = options.backend or "host", device_index = device_index,
  })
  for _, shard in ipairs(shards.tensors) do
    agent:register_tensor({ name = shard.name, dtype = shard.dtype, shape = shard.shape, memory = shard.memory,
      offset = shard.offset, rows = shard.rows })
  end

  local state = { actor = "resident", optimizer = "resident" }
  local function transition(part, from, to)
    return function()
      if state[part] ~= from then
        errors.raise("TRAINER_STATE", string.format("rank %d: %s is %s, not %s", options.rank, part, state[part], from),
          { rank = options.rank, phase = "schedule" })
      end
      state[part] = to
    end
  end
  agent:register_callback("offload_optimizer", transition("optimizer", "resident", "offloaded"))
  agent:register_callback("onload_optimizer", transition("optimizer", "offloaded", "resident"))
  agent:register_callback("offload_actor", transition("actor", "resident", "offloaded"))
  agent:register_callback("onload_actor", transition("actor", "offloaded", "resident"))

  -- Command faults: wrap the handler of every host command a fault names
  -- (die: SIGKILL itself; stop: SIGSTOP itself, a rank that stops answering;
  -- fail: answer with an error).
  local handled = {}
  for _, fault in ipairs(faults) do
    local cmd = fault.cmd
    local handler = agent.peer.handlers[cmd]
    if handler and not handled[cmd] then
      handled[cmd] = true
      local calls = 0
      agent.peer.handlers[cmd] = function(payload)
        calls = calls + 1
        for _, armed in ipairs(faults) do
          if armed.cmd == cmd and armed.nth == calls then
            if armed.kind == "die" then
              uv.kill(uv.os_getpid(), "sigkill")
            elseif armed.kind == "stop" then
              uv.kill(uv.os_getpid(), "sigstop")
            elseif armed.kind == "fail" then
              errors.raise("INJECTED", string.format("rank %d: injected %s failure", options.rank, cmd),
                { rank = options.rank, phase = cmd })
            end
          end
        end
        return handler(payload)
      end
    end
  end

  local function fires(kind, cmd, count)
    for _, fault in ipairs(faults) do
      if fault.kind == kind and fault.cmd == cmd and fault.nth == count then
        return true
      end
    end
    return false
  end

  local ok, err = pcall(function()
    agent:ready()
    for version = 1, options.versions do
      -- The optimizer step: every shard takes the next version's values.
      if not fires("stale", "publish", version) then
        M.generate(shards, version, transport)
      end
      if fires("stop", "publish", version) then
        uv.kill(uv.os_getpid(), "sigstop") -- a rank that stops before it publishes
      elseif fires("die", "publish", version) then
        uv.kill(uv.os_getpid(), "sigkill") -- a rank that dies before it publishes
      end
      local published, result = pcall(agent.publish, agent, version)
      if published then
        io.stdout:write(string.format("trainer rank %d: published model version %d (publication %s)\n",
          options.rank, result.model_version, result.publication_id))
      elseif type(result) == "table" and result.respawn then
        -- (A host that started this rank printed the failure itself.)
        io.stderr:write(string.format("wsync: trainer rank %d: step %d not published (the host respawns the "
          .. "runtime)%s\n", options.rank, version, agent:started_by_host() and "" or (": " .. tostring(result))))
      else
        error(result, 0)
      end
    end
  end)
  agent:close()
  for _, memory in ipairs(shards.memories) do
    memory:close()
  end
  if not ok then
    -- The session's failure, from the host that started this rank: its
    -- verdict says it, once; this rank only exits non-zero.
    if errors.is(err) and err.remote and agent:started_by_host() then
      errors.set_reported(err)
    end
    error(err, 0)
  end
end

return M
