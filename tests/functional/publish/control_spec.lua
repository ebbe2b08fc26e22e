-- The control messages of whole publications (the demo on the host backend
-- against the reference runtime, in a child wsync that counts the requests
-- its rollout sends): each publication asks the runtime start_update, a
-- load_chunk per chunk and finish_update, and the runtime's finish answer
-- says it released, so no release request follows.
local process = require("tests.helpers.process")

-- Runs the demo, counting every request of the rollout the session spawns;
-- prints "cmd=count" lines, "released=..." and "chunks=...".
local COUNTING = [[
package.path = "./?.lua;" .. package.path
local loop = require("wsync.loop")
local rollout_module = require("wsync.publish.rollout")
local asked, released = {}, {}
local spawn = rollout_module.spawn
rollout_module.spawn = function(options)
  local rollout = spawn(options)
  local class = getmetatable(rollout).__index
  local request = class.request
  class.request = function(self, cmd, payload)
    asked[cmd] = (asked[cmd] or 0) + 1
    local answer = request(self, cmd, payload)
    if cmd == "finish_update" then
      released[#released + 1] = tostring(answer.released)
    end
    return answer
  end
  return rollout
end
loop.spawn(function()
  local reports = require("wsync.publish.session").run(require("wsync.recipe").load("recipes/demo.lua"))
  for cmd, count in pairs(asked) do
    io.write(cmd, "=", count, "\n")
  end
  io.write("released=", table.concat(released, ","), "\n", "chunks=", reports[1].chunks, "\n")
end)
loop.run()
]]

describe("a publication's requests to the runtime", function()
  it("fold release into finish_update, whose answer says it released", function()
    local result = process.wsync({ "-e", COUNTING }, nil, { timeout = 60000 })
    assert.are.equal(0, result.code, result.stderr .. result.stdout)
    local values = {}
    for key, value in result.stdout:gmatch("\n?([%w_]+)=([^\n]*)\n") do
      values[key] = value
    end
    local chunks = tonumber(values.chunks)
    assert.is_true(chunks ~= nil and chunks > 1, result.stdout)
    assert.are.equal("3", values.start_update)
    assert.are.equal("3", values.finish_update)
    assert.are.equal(tostring(3 * chunks), values.load_chunk)
    assert.is_nil(values.release, "a release request was sent")
    assert.are.equal("true,true,true", values.released)
  end)
end)
