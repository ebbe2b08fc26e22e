--- The data plane's seam: the transport of a device backend. Policy (the
--- agent, the TP workers, the publication, the cleanup) asks this module for
--- the transport and never names shared memory or CUDA itself.
---
--- Every transport implements the interface documented in
--- wsync.transport.shm: packed buffers created, exported and attached by the
--- trainer ranks, imported and loaded from by the TP workers, fill and load
--- plans made once per chunk and run in one call each, resident memory, and
--- the removal of what a crash left behind.
local errors = require("wsync.errors")

local M = {}

--- The transport module of each device backend.
M.BY_BACKEND = { host = "wsync.transport.shm", cuda = "wsync.transport.cuda_ipc" }

--- The transport of `backend` ("host", "cuda"). Raises TRANSPORT naming the
--- backend when this build has none for it.
---@param backend string
---@return table
function M.for_backend(backend)
  local name = M.BY_BACKEND[backend]
  if not name then
    errors.raise("TRANSPORT", string.format("no transport for the %s backend in this build (it has: %s)",
      tostring(backend), table.concat(require("wsync.util").sorted_keys(M.BY_BACKEND), ", ")))
  end
  return require(name)
end

--- Closes every imported memory of `imported` (nil: none): each transport's
--- close_imported, whatever its memories are (mapped buffers, IPC mappings).
---@param imported table?
function M.close_imported(imported)
  for _, memory in pairs(imported or {}) do
    memory:close()
  end
end

--- The name a publication header gives the transport of `backend`.
---@param backend string
---@return string
function M.name(backend)
  return M.for_backend(backend).NAME
end

return M
