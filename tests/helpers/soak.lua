--- Test helper: many publications in a row on the host backend, with the
--- memory of every process sampled along the way. The calling process is the
--- host (wsync.publish.session in this Lua state); the synthetic trainer ranks and the
--- runtime are its children. Used by tests/functional/publish/soak_spec.lua (bounds)
--- and tests/bench/soak.lua (the figures in tests/bench/RESULTS.md).
local uv = require("luv")
local recipe_module = require("wsync.recipe")
local session_module = require("wsync.publish.session")
local util = require("wsync.util")

local M = {}

--- The recipe: the demo (two ranks, TP2, three chunks, the whole memory
--- schedule), or the recipe at `path`, `publications` steps long.
---@param publications integer
---@param verify boolean?
---@param path string?
function M.recipe(publications, verify, path)
  local recipe = recipe_module.load(path or "recipes/demo.lua")
  recipe.trainer.steps = publications
  recipe.verify = verify == true
  return recipe
end

-- The host's memory, and on the cuda backend the free memory of the ranks'
-- GPU as the host sees it (every process's allocations in it).
local function host_usage(session)
  local device_free = nil
  if session.recipe.backend == "cuda" then
    -- (First: the query gives the host a CUDA context, which the RSS read
    -- after it then includes in every sample alike.)
    local info = require("wsync.native.device").query("cuda", 0)
    device_free = info and info.free_bytes
  end
  local host = util.memory_usage()
  host.device_free_bytes = device_free
  return host
end

-- One sample: the memory of the host, every trainer rank, the runtime's main
-- process and each of its TP workers, by role.
local function sample(session, published)
  local processes = { { role = "host", usage = host_usage(session) } }
  local ranks = session.ranks:all("process_memory", function()
    return {}
  end, 30)
  for index, usage in ipairs(ranks) do
    processes[#processes + 1] = { role = "trainer rank " .. (index - 1), usage = usage }
  end
  local runtime = session.rollout:request("process_memory", {})
  processes[#processes + 1] = { role = "runtime main", usage = runtime.main }
  for index, usage in ipairs(runtime.workers) do
    processes[#processes + 1] = { role = "TP worker " .. (index - 1), usage = usage }
  end
  return { published = published, processes = processes }
end

--- Runs `options.publications` publications (inside a coroutine of
--- wsync.loop.spawn), sampling before publication `options.warmup + 1` and
--- every `options.every` after it, and at the end. Returns the samples and
--- the seconds the publications took. The session is closed before it
--- returns, also when a publication fails (which raises).
---@class SoakOptions
---@field publications integer
---@field warmup integer
---@field every integer
---@field verify boolean?
---@field progress fun(s: table)?
---@field recipe string?  default recipes/demo.lua

---@param options SoakOptions
---@return table[] samples, number seconds
function M.run(options)
  local recipe = M.recipe(options.publications, options.verify, options.recipe)
  local session = session_module.open(recipe)
  local samples = {}
  local started = uv.hrtime()
  local ok, err = pcall(function()
    local published = 0
    while session:wait_publish() do
      if published == options.warmup or (published > options.warmup and
          (published - options.warmup) % options.every == 0) then
        samples[#samples + 1] = sample(session, published)
        if options.progress then
          options.progress(samples[#samples])
        end
      end
      local _, failure = session:round()
      if failure then
        error(failure, 0)
      end
      published = published + 1
      if published == options.publications then
        break
      end
    end
    -- The ranks have published their last step; sample once more while the
    -- runtime is still up (the ranks leave once they are answered).
    local runtime = session.rollout:request("process_memory", {})
    local last = { published = published, processes = { { role = "host", usage = host_usage(session) },
      { role = "runtime main", usage = runtime.main } } }
    for index, usage in ipairs(runtime.workers) do
      last.processes[#last.processes + 1] = { role = "TP worker " .. (index - 1), usage = usage }
    end
    samples[#samples + 1] = last
  end)
  local seconds = (uv.hrtime() - started) / 1e9
  session_module.close(session)
  if not ok then
    error(err, 0)
  end
  return samples, seconds
end

--- Growth of each role from the first sample to the last that has it:
--- {role = {heap = bytes, rss = bytes, first = usage, last = usage}}.
---@param samples table[]
function M.growth(samples)
  local first, last = {}, {}
  for _, taken in ipairs(samples) do
    for _, process in ipairs(taken.processes) do
      first[process.role] = first[process.role] or process.usage
      last[process.role] = process.usage
    end
  end
  local growth = {}
  for role, usage in pairs(first) do
    growth[role] = {
      heap = last[role].lua_heap_bytes - usage.lua_heap_bytes,
      rss = last[role].rss_bytes - usage.rss_bytes,
      first = usage, last = last[role],
    }
  end
  return growth
end

return M
