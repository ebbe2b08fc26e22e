--- Small helpers shared by wsync's modules.
local uv = require("luv")

local M = {}

--- The values `...` as a list with their count in `n` (nils kept).
---@return table
function M.pack(...)
  return { n = select("#", ...), ... }
end

--- A new table with the fields of `defaults`, then those of `overrides` laid
--- over them (one level; neither is changed).
---@param defaults table
---@param overrides table?
---@return table
function M.merged(defaults, overrides)
  local result = {}
  for key, value in pairs(defaults) do
    result[key] = value
  end
  for key, value in pairs(overrides or {}) do
    result[key] = value
  end
  return result
end

--- This process's memory after a full collection: the Lua heap and the
--- resident set, in bytes (soak tests and `wsync repl` read them).
---@return {lua_heap_bytes: integer, rss_bytes: integer, pid: integer}
function M.memory_usage()
  collectgarbage("collect")
  collectgarbage("collect") -- finalizers of the first pass free more
  return {
    lua_heap_bytes = math.floor(collectgarbage("count") * 1024),
    rss_bytes = uv.resident_set_memory(),
    pid = uv.os_getpid(),
  }
end

return M
