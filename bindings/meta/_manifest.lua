---@meta wsync._manifest
-- LuaCATS stubs for `wsync._manifest` (bindings/l_manifest.c): streaming
-- SHA-256 manifests over structural tensor records. Not loaded at run time;
-- read by the Lua language server. tests/bindings/meta_spec.lua checks the
-- stubs. A userdata class is named after its metatable, in CamelCase
-- (metatable wsync.manifest_segment: class wsync.ManifestSegment).

---@class wsync._manifest
local manifest = {}

---@return wsync.Manifest|nil manifest, string? message, string? code
function manifest.new() end

---@return wsync.ManifestSegment|nil segment, string? message, string? code
function manifest.segment() end

---@class wsync.Manifest
local Manifest = {}

---@param name string
---@param dtype string  "bfloat16", "float32", ...
---@param shape integer[]
---@return wsync.Manifest|nil self, string? message, string? code
function Manifest:add(name, dtype, shape) end

--- Adds a segment's records, in order, as if added one by one.
---@param segment wsync.ManifestSegment
---@return wsync.Manifest|nil self, string? message, string? code
function Manifest:add_segment(segment) end

---@return string|nil digest, string? message, string? code  64 hex characters
function Manifest:finish() end

---@return integer
function Manifest:count() end

---@return number bytes  sum of the records' byte counts
function Manifest:bytes() end

function Manifest:close() end

--- Records encoded once (e.g. per chunk) and added to many manifests.
---@class wsync.ManifestSegment
local Segment = {}

---@param name string
---@param dtype string
---@param shape integer[]
---@return wsync.ManifestSegment|nil self, string? message, string? code
function Segment:add(name, dtype, shape) end

---@return integer
function Segment:count() end

function Segment:close() end

return manifest
