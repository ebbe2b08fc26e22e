-- Benchmark: where a whole publication's time goes, phase by phase, for a
-- recipe on its own backend (by default the demo, on the host backend: its
-- tiny model makes the phases mostly control).
--
--   wsync tests/bench/publish_phases.lua [RECIPE] [PUBLICATIONS]
--       RECIPE        default recipes/demo.lua; run with its model, trainer,
--                     runtime and buffers, its schedule replaced by
--                     "publish" alone, no bootstrap, no verify
--       PUBLICATIONS  default 60; the session keeps the last 32 reports
--                     (wsync.publish.session.KEPT_REPORTS), the first of them
--                     is left out of the medians
--
-- Prints the median of each phase (preflight, init, start, chunks with its
-- fill and load, verify, finish, release) and of the whole publication, ms.
package.path = "./?.lua;" .. package.path
local loop = require("wsync.loop")
local recipe_module = require("wsync.recipe")
local session = require("wsync.publish.session")

local path = arg[1] or "recipes/demo.lua"
local publications = tonumber(arg[2] or "") or 60

loop.spawn(function()
  local recipe = recipe_module.load(path)
  recipe.trainer.steps = publications
  recipe.bootstrap, recipe.schedule, recipe.verify = {}, { "publish" }, false
  local reports = session.run(recipe)
  local parts = {}
  for _, phase in ipairs({ "preflight", "init", "start", "chunks", "fill", "load", "verify", "finish", "release",
    "total" }) do
    local values = {}
    for at = 2, #reports do
      values[#values + 1] = (reports[at].timings[phase] or 0) * 1e3
    end
    table.sort(values)
    parts[#parts + 1] = string.format("%s %.3f", phase, values[math.floor(#values / 2) + 1] or 0)
  end
  print(string.format("publish_phases: %s, %d publications of %d chunks, the medians of the last %d; ms: %s", path,
    publications, reports[1].chunks, #reports - 1, table.concat(parts, ", ")))
end)
loop.run()
