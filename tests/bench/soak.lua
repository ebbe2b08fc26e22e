-- Soak: many publications in a row on the host backend, with the memory of
-- every process (host, trainer ranks, runtime main, TP workers) read after a
-- full collection along the way: the Lua heap and the resident set.
--
--   wsync tests/bench/soak.lua [PUBLICATIONS] [EVERY]
--       PUBLICATIONS  demo publications to run (default 2000)
--       EVERY         publications between samples (default 250)
--
-- The recipe is recipes/demo.lua (two synthetic ranks, TP2 reference runtime,
-- three chunks, the whole memory schedule, resident check off), run
-- in-process: this process is the host. The first sample is taken after 50
-- publications (warm-up); the table shows each process's heap and RSS then
-- and at the end, and the heap growth per publication in between.
package.path = "./?.lua;" .. package.path
local loop = require("wsync.loop")
local soak = require("tests.helpers.soak")

local publications = tonumber(arg[1] or "") or 2000
local every = tonumber(arg[2] or "") or 250
local WARMUP = 50

local function kib(bytes)
  return string.format("%.1f KiB", bytes / 1024)
end

local function mib(bytes)
  return string.format("%.1f MiB", bytes / 1048576)
end

loop.spawn(function()
  local samples, seconds = soak.run({ publications = publications, warmup = WARMUP, every = every,
    progress = function(sample)
      io.stderr:write(string.format("soak: %d publications, host heap %s\n", sample.published,
        kib(sample.processes[1].usage.lua_heap_bytes)))
    end })
  local span = samples[#samples].published - samples[1].published
  print(string.format("soak: %d publications in %.1f s (%.2f ms each); samples after %d and %d", publications,
    seconds, seconds * 1e3 / publications, samples[1].published, samples[#samples].published))
  print(string.format("%-15s %12s %12s %14s %10s %10s %10s", "process", "heap first", "heap last",
    "heap / publ.", "rss first", "rss last", "rss growth"))
  local growth = soak.growth(samples)
  local roles = {}
  for role in pairs(growth) do
    roles[#roles + 1] = role
  end
  table.sort(roles)
  for _, role in ipairs(roles) do
    local g = growth[role]
    print(string.format("%-15s %12s %12s %14s %10s %10s %10s", role, kib(g.first.lua_heap_bytes),
      kib(g.last.lua_heap_bytes), string.format("%.1f B", g.heap / span), mib(g.first.rss_bytes),
      mib(g.last.rss_bytes), mib(g.rss)))
  end
end)
loop.run()
