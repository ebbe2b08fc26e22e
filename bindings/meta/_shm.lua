---@meta wsync._shm
-- LuaCATS stubs for `wsync._shm` (bindings/l_shm.c): shared-memory buffers of
-- the host backend. Not loaded at run time; read by the Lua language server.
-- tests/bindings/meta_spec.lua checks the stubs. A userdata class is named
-- after its metatable, in CamelCase (metatable wsync.shm: class wsync.Shm).

---@class wsync._shm
local shm = {}

---@param bytes integer
---@return wsync.Shm|nil buffer, string? message, string? code
function shm.create(bytes) end

--- Private memory of this process (no name in /dev/shm).
---@param bytes integer
---@return wsync.Shm|nil buffer, string? message, string? code
function shm.anonymous(bytes) end

---@param name string
---@return wsync.Shm|nil buffer, string? message, string? code
function shm.open(name) end

---@class wsync.Shm
local Shm = {}

---@return string name  "/wsync-..."
function Shm:name() end

---@return integer
function Shm:size() end

---@return boolean
function Shm:is_owner() end

---@return lightuserdata pointer  the mapped bytes (for ffi.cast)
function Shm:pointer() end

---@param offset integer
---@param bytes string
function Shm:write(offset, bytes) end

---@param offset integer
---@param length integer
---@return string
function Shm:read(offset, length) end

---@param source wsync.Shm
---@param source_offset integer
---@param offset integer
---@param length integer
---@return true|nil ok, string? message, string? code
function Shm:copy_from(source, source_offset, offset, length) end

---@param offset integer?  0 by default
---@param length integer?  to the end by default
---@return string|nil hex, string? message, string? code
function Shm:sha256(offset, length) end

---@return true|nil ok, string? message, string? code
function Shm:unlink() end

--- Unmaps, and unlinks when this buffer created the segment.
---@return true|nil ok, string? message, string? code
function Shm:close() end

return shm
