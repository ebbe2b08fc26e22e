-- wsync.trainer.agent: a registered tensor's memory stays alive as long as
-- the agent does, also when the trainer keeps no reference of its own (the
-- agent reads its pointer again at every publication's start).
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
