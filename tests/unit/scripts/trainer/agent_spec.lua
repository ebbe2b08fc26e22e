-- wsync.trainer.agent: a registered tensor's memory stays alive as long as
-- the agent does, also when the trainer keeps no reference of its own (the
-- agent reads its pointer again at every publication's start).
local ffi = require("ffi")
local async = require("tests.helpers.async")
local agent_module = require("wsync.trainer.agent")
local endpoint_module = require("wsync.control.endpoint")
local shm = require("wsync.native.shm")

describe("wsync.trainer.agent register_tensor", function()
  it("keeps the object that owns a tensor's memory referenced", function()
    async.run_async(function()
      local endpoint = endpoint_module.listen({ handlers_for = function() return {} end })
      local agent = agent_module.connect({ endpoint = endpoint.path, rank = 0, world = 1 })
      do
        -- The only reference to the memory is the one the agent keeps.
        local memory = assert(shm.anonymous(4096))
        memory:write(0, "shard bytes")
        agent:register_tensor({ name = "model.norm.weight", dtype = "bfloat16", shape = { 16 }, memory = memory })
      end
      collectgarbage("collect")
      collectgarbage("collect")
      local kept = agent.tensors[1].memory
      assert.is_not_nil(kept, "the agent kept only a pointer")
      assert.are.equal("shard bytes", kept:read(0, 11))
      agent:close()
      endpoint:close()
    end)
  end)

  it("refuses a tensor without memory, naming it", function()
    async.run_async(function()
      local endpoint = endpoint_module.listen({ handlers_for = function() return {} end })
      local agent = agent_module.connect({ endpoint = endpoint.path, rank = 0, world = 1 })
      local ok, err = pcall(agent.register_tensor, agent, { name = "w", dtype = "bfloat16", shape = { 4 } })
      assert.is_false(ok)
      assert.matches("register_tensor w: memory required", err, 1, true)
      agent:close()
      endpoint:close()
    end)
  end)
end)

describe("wsync.trainer.agent over TCP", function()
  it("proves the session's token first; with another token it raises AGENT_CONNECT with the host's refusal",
    function()
      async.run_async(function()
        local refused = {}
        local endpoint = endpoint_module.listen({ tcp = "127.0.0.1:0", handlers_for = function()
          return { state = function() return { served = true } end }
        end, on_refused = function(line)
          refused[#refused + 1] = line
        end })
        local ok, err = pcall(function()
          local agent = agent_module.connect({ endpoint = endpoint.tcp_endpoint, rank = 0, world = 1 })
          assert.are.same({ served = true }, agent.peer:request("state", {}, 5))
          agent:close()
          local wrong = endpoint.tcp_endpoint:gsub("token=%x+", "token=" .. string.rep("0", 32))
          local connected, failure = pcall(agent_module.connect, { endpoint = wrong, rank = 0, world = 1 })
          assert.is_false(connected)
          assert.are.equal("AGENT_CONNECT", failure.code)
          assert.matches("^rank 0: the host at tcp://127%.0%.0%.1:%d+ did not take this connection: refused: this "
            .. "session's endpoint takes connections over TCP with its token only$", failure.message)
          assert.are.equal(1, #refused)
          assert.matches(": a wrong token$", refused[1])
        end)
        endpoint:close()
        assert(ok, err)
      end)
    end)
end)

describe("wsync.trainer.agent move_tensor", function()
  -- An agent with one {pointer, size} tensor of 4 rows of 8 bytes (two
  -- buffers to move between, kept alive here), on an endpoint that never
  -- answers; `run(fn)` runs fn(agent, buffers) and closes both.
  local function run(fn)
    async.run_async(function()
      local endpoint = endpoint_module.listen({ handlers_for = function() return {} end })
      local agent = agent_module.connect({ endpoint = endpoint.path, rank = 0, world = 1 })
      local buffers = { ffi.new("char[32]"), ffi.new("char[64]") }
      agent:register_tensor({ name = "w", dtype = "bfloat16", shape = { 4, 4 }, memory = { pointer =
        ffi.cast("void *", buffers[1]), size = 32 } })
      local ok, err = pcall(fn, agent, buffers)
      agent:close()
      endpoint:close()
      assert(ok, err)
    end)
  end

  local function begin(agent)
    return agent:_begin({ family = "qwen3_moe", publication_id = "p" })
  end

  it("points the tensor at its new memory, read at the next publication's start", function()
    run(function(agent, buffers)
      begin(agent)
      local before = agent.signature
      agent:move_tensor("w", ffi.cast("void *", buffers[2]), 64)
      begin(agent)
      assert.are_not.equal(before, agent.signature)
      assert.are.equal(tostring(ffi.cast("void *", buffers[2])), agent.signature)
    end)
  end)

  it("refuses an unknown name, memory that is too small and a NULL pointer with a size", function()
    run(function(agent, buffers)
      local ok, err = pcall(agent.move_tensor, agent, "v", ffi.cast("void *", buffers[2]), 64)
      assert.is_false(ok)
      assert.matches("move_tensor: no tensor v is registered", err, 1, true)
      ok, err = pcall(agent.move_tensor, agent, "w", ffi.cast("void *", buffers[2]), 16)
      assert.is_false(ok)
      assert.matches("move_tensor w: 16 bytes do not hold its 4 rows (32 bytes)", err, 1, true)
      ok, err = pcall(agent.move_tensor, agent, "w", nil, 32)
      assert.is_false(ok)
      assert.matches("move_tensor w: the pointer is NULL", err, 1, true)
    end)
  end)

  it("refuses a tensor registered on a memory object", function()
    run(function(agent)
      local memory = assert(shm.anonymous(4096))
      agent:register_tensor({ name = "s", dtype = "bfloat16", shape = { 16 }, memory = memory })
      local ok, err = pcall(agent.move_tensor, agent, "s", memory:pointer(), 4096)
      assert.is_false(ok)
      assert.matches("it was registered on a memory object", err, 1, true)
    end)
  end)

  it("fails a publication that starts while the tensor is not in memory, naming it", function()
    run(function(agent, buffers)
      agent:move_tensor("w", nil, 0)
      local ok, err = pcall(begin, agent)
      assert.is_false(ok)
      assert.are.equal("TENSOR_UNAVAILABLE", err.code)
      assert.matches("tensor w is not in memory at the publication's start", err.message, 1, true)
      agent:move_tensor("w", ffi.cast("void *", buffers[1]), 32)
      begin(agent)
    end)
  end)

  it("starts a publication with the begin its first fill brings, before the fill reads anything", function()
    run(function(agent, buffers)
      local fill = agent:_handlers().fill
      local id = string.rep("0f", 16)
      agent:move_tensor("w", nil, 0)
      local ok, err = pcall(fill, { chunk = 1, buffer = 1, begin = { family = "qwen3_moe", publication_id = id } })
      assert.is_false(ok)
      assert.are.equal("TENSOR_UNAVAILABLE", err.code)
      agent:move_tensor("w", ffi.cast("void *", buffers[1]), 32)
      -- (Begun; then no buffers to fill: this agent attached none.)
      ok, err = pcall(fill, { chunk = 1, buffer = 1, begin = { family = "qwen3_moe", publication_id = id } })
      assert.is_false(ok)
      assert.are.equal("AGENT_STATE", err.code)
      assert.are.equal(id, agent.publication)
      assert.are.same({}, agent.consumed)
      assert.is_nil(agent:_handlers().begin, "begin is no command of its own")
    end)
  end)

  it("fails a direct-path publication whose storage moved since it was exported", function()
    run(function(agent, buffers)
      agent.direct = agent:_pointer_signature() -- as _export_storage leaves it
      begin(agent)
      agent:move_tensor("w", ffi.cast("void *", buffers[2]), 64)
      local ok, err = pcall(begin, agent)
      assert.is_false(ok)
      assert.are.equal("STORAGE_MOVED", err.code)
      assert.matches("storage moved since the direct path exported it", err.message, 1, true)
    end)
  end)
end)

describe("wsync.trainer.agent with chunks ordered on the device", function()
  -- An agent whose transport records what it is asked to release and settle
  -- (the cuda transport's gate, played here: no GPU).
  local function run(fn)
    async.run_async(function()
      local endpoint = endpoint_module.listen({ handlers_for = function() return {} end })
      local agent = agent_module.connect({ endpoint = endpoint.path, rank = 0, world = 1 })
      local calls = {}
      local shm_transport = agent.transport
      agent.transport = setmetatable({
        release_gate = function(_, value)
          calls[#calls + 1] = "release " .. tostring(value)
          return true
        end,
        settle = function()
          calls[#calls + 1] = "settle"
          return true
        end,
      }, { __index = shm_transport })
      local ok, err = pcall(fn, agent, calls)
      agent.transport = shm_transport
      agent:close()
      endpoint:close()
      assert(ok, err)
    end)
  end

  it("refuses a gate on a transport that cannot order chunks on the device", function()
    run(function(agent)
      local ok, err = pcall(agent._handlers(agent).init_buffers, { count = 1, bytes = 64, gate = true })
      assert.is_false(ok)
      assert.are.equal("AGENT_STATE", err.code)
      assert.matches("the shm transport cannot order chunks on the device", err.message, 1, true)
    end)
  end)

  it("releases fills queued behind its worker's loads at an abort, at the next begin, and at close; once", function()
    run(function(agent, calls)
      local handlers = agent:_handlers()
      agent.gate_waits = 7
      handlers.abort({ code = "PUBLISH_FAILED", message = "the runtime died" })
      assert.are.same({ "release 7" }, calls)
      assert.are.equal("PUBLISH_FAILED", agent.aborted.code)
      handlers.abort({ code = "PUBLISH_FAILED", message = "again" })
      assert.are.same({ "release 7" }, calls) -- (nothing left queued)
      agent.gate_waits = 9
      agent:_begin({ family = "qwen3_moe", publication_id = "p" })
      assert.are.same({ "release 7", "release 9" }, calls)
      agent.gate_waits = 11
      agent:_release_buffers()
      assert.are.same({ "release 7", "release 9", "release 11" }, calls)
    end)
  end)

  it("waits for its queued fills at verify, and then has nothing to release", function()
    run(function(agent, calls)
      agent:_begin({ family = "qwen3_moe", publication_id = "p" })
      agent.gate_waits = 3
      agent._handlers(agent).verify({})
      assert.are.same({ "settle" }, calls)
      agent:_release_buffers()
      assert.are.same({ "settle" }, calls)
    end)
  end)
end)

describe("wsync.trainer.agent's last fill", function()
  -- An agent of one rank with one tensor on the direct path (its fills move
  -- nothing, so no buffers are needed), on an endpoint that never answers.
  local function run(fn)
    async.run_async(function()
      local endpoint = endpoint_module.listen({ handlers_for = function() return {} end })
      local agent = agent_module.connect({ endpoint = endpoint.path, rank = 0, world = 1 })
      local memory = assert(shm.anonymous(4096))
      agent:register_tensor({ name = "model.norm.weight", dtype = "bfloat16", shape = { 16 }, memory = memory })
      agent.direct = agent:_pointer_signature() -- as _export_storage leaves it
      local ok, err = pcall(fn, agent, agent:_handlers())
      agent:close()
      endpoint:close()
      assert(ok, err)
    end)
  end

  local BEGIN = { family = "qwen3_moe", publication_id = string.rep("0f", 16) }
  local SLOTS = { { name = "model.norm.weight", offset = 0 } }

  it("answers with the consumed manifest when asked (verify), which ends the publication", function()
    run(function(_, handlers)
      local report = handlers.fill({ chunk = 1, buffer = 1, slots = SLOTS, begin = BEGIN, verify = true })
      local expected = require("wsync.native.manifest").of({ { "model.norm.weight", "bfloat16", { 16 } } })
      assert.are.same({ manifest = expected.digest, tensors = 1, bytes = expected.bytes, rank = 0 }, report.consumed)
      local ok, err = pcall(handlers.verify, {})
      assert.is_false(ok)
      assert.matches("verify before begin", err.message, 1, true)
      -- (Not asked: no manifest, and the publication goes on.)
      assert.is_nil(handlers.fill({ chunk = 1, buffer = 1, begin = BEGIN }).consumed)
      assert.are.equal(expected.digest, handlers.verify({}).manifest)
    end)
  end)

  it("refuses to answer a fill ordered on the device with the manifest (it is only queued)", function()
    run(function(_, handlers)
      local ok, err = pcall(handlers.fill, { chunk = 1, buffer = 1, slots = SLOTS, begin = BEGIN, verify = true,
        gate = { seq = 1 } })
      assert.is_false(ok)
      assert.are.equal("BAD_MESSAGE", err.code)
      assert.matches("its consumed manifest comes with verify", err.message, 1, true)
    end)
  end)
end)
