--- Manifests: SHA-256 over ordered structural tensor records (name, dtype,
--- shape, element and byte counts). The byte encoding is documented in
--- host/manifest.h; nothing here hashes tensor values.
local native = require("wsync._manifest")

local M = {}

--- Starts a streaming manifest: `m:add(name, dtype, shape)`, then
--- `m:finish()` for the hex digest; `m:close()` frees it.
M.new = native.new

--- Hashes a list of records `{name, dtype, shape}` (or `{name=, dtype=,
--- shape=}`) in order. Returns `{digest, count, bytes}`; raises on a bad record
--- naming its position.
---@param records table[]
---@return {digest: string, count: integer, bytes: number}
function M.of(records)
  local manifest = assert(native.new())
  for index, record in ipairs(records) do
    local name = record.name or record[1]
    local dtype = record.dtype or record[2]
    local shape = record.shape or record[3]
    -- A bad argument raises and a refused record returns nil: both name it.
    local called, ok, message = pcall(manifest.add, manifest, name, dtype, shape)
    if not called then
      ok, message = nil, ok
    end
    if not ok then
      manifest:close()
      error(string.format("manifest record %d (%s): %s", index, tostring(name), message), 2)
    end
  end
  local digest = assert(manifest:finish())
  local result = { digest = digest, count = manifest:count(), bytes = manifest:bytes() }
  manifest:close()
  return result
end

return M
