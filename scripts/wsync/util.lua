--- Small helpers shared by wsync's modules.
local uv = require("luv")

local M = {}

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
