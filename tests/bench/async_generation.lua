-- Asynchronous RL figures (issue 12): rollout replicas generating across
-- publications, paused in keep mode around each (two phases), with R
-- replicas of TP1 fed by R synthetic trainer ranks on the host backend.
--
--   wsync tests/bench/async_generation.lua [ROUNDS] [REPLICAS,...]
--       ROUNDS    publications per replica count (default 200)
--       REPLICAS  the replica counts to run (default 1,2,4)
--
-- Per replica count: the time to pause every replica (the two-phase pause,
-- p50 and p99), the generation stall per publication (from the pause's start
-- to the resume's end: no replica produces a token meanwhile), the
-- publication alone, and the tokens generated per version (4 requests
-- streaming in every replica, 3 ms of generation between publications).
package.path = "./?.lua;" .. package.path
local loop = require("wsync.loop")
local uv = require("luv")

local rounds = tonumber(arg[1] or "") or 200
local counts = {}
for count in (arg[2] or "1,2,4"):gmatch("%d+") do
  counts[#counts + 1] = tonumber(count)
end

local function percentile(values, p)
  local sorted = {}
  for i, value in ipairs(values) do
    sorted[i] = value
  end
  table.sort(sorted)
  return sorted[math.max(1, math.ceil(#sorted * p))]
end

loop.spawn(function()
  local recipe_module = require("wsync.recipe")
  local rows = {}
  for _, replicas in ipairs(counts) do
    local recipe = recipe_module.load("recipes/demo_async.lua")
    recipe.trainer.ranks, recipe.trainer.steps = replicas, rounds
    recipe.runtime.replicas = replicas
    recipe.verify = false
    recipe.rollout = nil -- (it submits and polls its own requests)
    recipe_module.check(recipe)
    local session = require("wsync.publish.session").open(recipe)
    session:wait_publish()
    local requests = {}
    for i = 1, 4 do
      requests[i] = { prompt = { i }, max_tokens = 65536 }
    end
    session.rollout:request("submit", { requests = requests })
    -- Time the pause and the resume of every round (the session's own calls).
    local rollout = session.rollout
    local pauses, stalls, started = {}, {}, nil
    local pause, request = rollout.pause, rollout.request
    rollout.pause = function(self, payload)
      started = uv.hrtime()
      local result = pause(self, payload)
      pauses[#pauses + 1] = (uv.hrtime() - started) / 1e6
      return result
    end
    rollout.request = function(self, cmd, payload)
      local result = request(self, cmd, payload)
      if cmd == "resume" and started then
        stalls[#stalls + 1] = (uv.hrtime() - started) / 1e6
      end
      return result
    end
    local publications = {}
    for _ = 1, rounds do
      session:wait_publish()
      local report = assert(session:round())
      publications[#publications + 1] = report.timings.total * 1e3
      loop.sleep(3)
    end
    local polled = rollout:request("poll", {})
    local tokens, versions = 0, {}
    for _, replica in ipairs(polled.replicas or { polled }) do
      for _, r in ipairs(replica.requests) do
        tokens = tokens + r.generated
        for _, span in ipairs(r.spans) do
          versions[span.version] = true
        end
      end
    end
    local version_count = 0
    for _ in pairs(versions) do
      version_count = version_count + 1
    end
    rows[#rows + 1] = string.format("| %d | %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.1f |", replicas, rounds,
      percentile(pauses, 0.5), percentile(pauses, 0.99), percentile(stalls, 0.5), percentile(stalls, 0.99),
      percentile(publications, 0.5), tokens / version_count / replicas)
    session:close()
  end
  io.stdout:write("\n| replicas | rounds | pause p50 ms | pause p99 ms | stall p50 ms | stall p99 ms | publication "
    .. "p50 ms | tokens per version per replica |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n")
  io.stdout:write(table.concat(rows, "\n"), "\n")
end, function(ok, err)
  if not ok then
    io.stderr:write("async_generation: ", tostring(err), "\n")
    os.exit(1)
  end
end)
loop.run()
