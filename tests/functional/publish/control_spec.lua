-- The control messages of whole publications (the demo on the host backend,
-- run in this process against the reference runtime): each publication asks
-- the runtime start_update, a load_chunk per chunk and finish_update, and the
-- runtime's finish answer says it released, so no release request follows.
local process = require("tests.helpers.process")
local recipe_module = require("wsync.recipe")
local rollout_module = require("wsync.publish.rollout")
local session = require("wsync.publish.session")

describe("a publication's requests to the runtime", function()
  local spawn = rollout_module.spawn
  local class, request = nil, nil

  after_each(function()
    rollout_module.spawn = spawn
    if class then
      class.request = request
    end
  end)

  it("fold release into finish_update, whose answer says it released", function()
    local asked, released = {}, {}
    -- (Every request of the rollout the session spawns, counted.)
    rollout_module.spawn = function(options)
      local rollout = spawn(options)
      class = getmetatable(rollout).__index
      request = request or class.request
      class.request = function(self, cmd, payload)
        asked[cmd] = (asked[cmd] or 0) + 1
        local answer = request(self, cmd, payload)
        if cmd == "finish_update" then
          released[#released + 1] = answer.released
        end
        return answer
      end
      return rollout
    end
    local reports = process.in_coroutine(function()
      return session.run(recipe_module.load("recipes/demo.lua"))
    end)
    assert.are.equal(3, #reports)
    assert.are.equal(3, asked.start_update)
    assert.are.equal(3, asked.finish_update)
    assert.are.equal(3 * reports[1].chunks, asked.load_chunk)
    assert.is_nil(asked.release)
    assert.are.same({ true, true, true }, released)
  end)
end)
