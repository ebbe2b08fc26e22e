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

--- What every transport has: its interface (wsync.transport.shm documents
--- each), the constants and functions by name.
M.INTERFACE = {
  "NAME", "BINDS_MEMORY", "GATHER",
  "create", "descriptors", "attach", "sources", "nccl_id", "plan_fill", "close_plan", "fill", "release",
  "import", "close_imported", "plan_load", "load", "allocate", "copy_host", "host_copy", "fill_pattern", "checksum",
  "remove_leftovers",
}

--- What a transport may have beyond the interface: each capability, what it
--- is for and the functions it brings. A transport declares the ones it has
--- in its `CAPABILITIES` ({name = true}); policy asks `M.can`, never whether
--- a function is there, and the transports' spec checks each declaration
--- against the functions (tests/unit/scripts/transport/capabilities_spec.lua).
M.CAPABILITIES = {
  gates = { what = "chunks ordered on the device (buffers.order = \"device\")",
    functions = { "gate_descriptor", "import_gate", "release_gate", "settle" } },
  direct = { what = "the direct path: a TP worker reads the trainer's own storage", functions = { "export_memories" } },
  device_check = { what = "synthetic values filled and checked on the device",
    functions = { "fill_synthetic", "check_synthetic" } },
  named_leftovers = { what = "buffer names that outlive a process killed with SIGKILL, removed by the next host",
    functions = { "remove_dead_segments" } },
}

--- Whether `transport` has `capability` (a key of M.CAPABILITIES).
---@param transport table
---@param capability string
---@return boolean
function M.can(transport, capability)
  assert(M.CAPABILITIES[capability], "no transport capability " .. tostring(capability))
  return (transport.CAPABILITIES or {})[capability] == true
end

--- What is wrong with `transport` against its declaration: a function or
--- constant of the interface it lacks, a declared capability without its
--- functions, an undeclared one whose functions it has, a capability the
--- list above does not know. An empty list when nothing is.
---@param transport table
---@return string[]
function M.problems(transport)
  local found = {}
  for _, name in ipairs(M.INTERFACE) do
    if transport[name] == nil then
      found[#found + 1] = "lacks " .. name .. " of the interface"
    end
  end
  local declared = transport.CAPABILITIES or {}
  for name in pairs(declared) do
    if not M.CAPABILITIES[name] then
      found[#found + 1] = "declares an unknown capability " .. tostring(name)
    end
  end
  for _, name in ipairs(require("wsync.util").sorted_keys(M.CAPABILITIES)) do
    for _, fn in ipairs(M.CAPABILITIES[name].functions) do
      if declared[name] and type(transport[fn]) ~= "function" then
        found[#found + 1] = string.format("declares %s but lacks %s", name, fn)
      elseif not declared[name] and transport[fn] ~= nil then
        found[#found + 1] = string.format("has %s of %s without declaring it", fn, name)
      end
    end
  end
  return found
end

--- Every transport of this build that has `capability`, as modules.
---@param capability string
---@return table[]
function M.with(capability)
  local out = {}
  for _, backend in ipairs(require("wsync.util").sorted_keys(M.BY_BACKEND)) do
    local transport = require(M.BY_BACKEND[backend])
    if M.can(transport, capability) then
      out[#out + 1] = transport
    end
  end
  return out
end

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
