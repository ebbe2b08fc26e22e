--- Manifests: SHA-256 over ordered structural tensor records (name, dtype,
--- shape, element and byte counts). The byte encoding is documented in
--- host/manifest.h; nothing here hashes tensor values.
local native = require("wsync._manifest")

local M = {}

--- Starts a streaming manifest: `m:add(name, dtype, shape)`, then
--- `m:finish()` for the hex digest; `m:close()` frees it.
M.new = native.new

--- Starts a segment: records encoded once (`s:add(name, dtype, shape)`) and
--- added to a manifest in one step, `m:add_segment(s)`, as often as needed:
--- a chunk's records, the same in every publication. `s:close()` frees it.
M.segment = native.segment

---@class wsync.DigestCache
local DigestCache = {}
DigestCache.__index = DigestCache

--- Manifests of sequences of segments, each sequence hashed once: a
--- publication that moves a session's chunks in the same order as the one
--- before consumes the same records, so its manifest is the one computed
--- then (the segments do not change while the cache holds them: clear it
--- when one does).
---@return wsync.DigestCache
function M.digest_cache()
  return setmetatable({ entries = {} }, DigestCache)
end

--- The manifest of the segments `segments[key]` for the keys of `sequence`,
--- in order: `{digest, count, bytes}`, or nil and a message.
---@param sequence any[]
---@param segments table
---@return {digest: string, count: integer, bytes: number}|nil, string?
function DigestCache:of(sequence, segments)
  local key = table.concat(sequence, ",")
  local entry = self.entries[key]
  if entry then
    return entry
  end
  local manifest, message = native.new()
  if not manifest then
    return nil, message
  end
  for _, item in ipairs(sequence) do
    local ok
    ok, message = manifest:add_segment(segments[item])
    if not ok then
      manifest:close()
      return nil, message
    end
  end
  local digest
  digest, message = manifest:finish()
  if not digest then
    manifest:close()
    return nil, message
  end
  entry = { digest = digest, count = manifest:count(), bytes = manifest:bytes() }
  manifest:close()
  self.entries[key] = entry
  return entry
end

--- Forgets every digest (a segment changed).
function DigestCache:clear()
  self.entries = {}
end

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

--- Runs `fill(segment)` to add a chunk's records to `segment`; when it
--- raises, closes the segment and raises the error again.
---@param segment userdata
---@param fill fun(segment: userdata)
function M.fill_segment(segment, fill)
  local ok, err = pcall(fill, segment)
  if not ok then
    segment:close()
    error(err, 0)
  end
end

return M
