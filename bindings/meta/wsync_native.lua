---@meta
-- LuaCATS stubs for wsync's C modules (bindings/l_*.c and bindings/wsync.c).
-- Not loaded at run time; read by the Lua language server.

---@class wsync._core
---@field version string          wsync version ("0.1.0")
---@field status table<string, integer>  status codes by name (OK = 0, EINVAL = -1, ...)
---@field cuda_built boolean      the binary carries the cuda backend
---@field cdef string             the C core's declarations for ffi.cdef
local core = {}
---@param code integer
---@return string name  e.g. "EINVAL"; "EUNKNOWN" for an unknown code
function core.status_name(code) end
---@param code integer
---@return string message
function core.status_message(code) end

---@class wsync._host
local host = {}
--- SIGINT raises "interrupted" in running Lua code until disarmed.
function host.arm_interrupt() end
function host.disarm_interrupt() end
---@param handler fun(err: any)?  receives errors thrown in libuv callbacks
function host.set_callback_error_handler(handler) end
---@return string? root  the scripts directory, or nil for embedded bytecode
function host.script_root() end
---@return string[] modules  names of the embedded Lua modules
function host.embedded_modules() end
--- Raises the exit sentinel; installed as os.exit.
---@param code integer|boolean?
function host.exit(code) end
---@return integer pid
function host.pid() end
--- The message handler the host uses for protected calls (adds tracebacks).
function host.message_handler(err) end

---@class wsync.manifest.native
local manifest_native = {}
---@return wsync.Manifest|nil manifest, string? message, string? code
function manifest_native.new() end

---@class wsync.Manifest
local Manifest = {}
---@param name string
---@param dtype string  "bfloat16", "float32", ...
---@param shape integer[]
---@return wsync.Manifest|nil self, string? message, string? code
function Manifest:add(name, dtype, shape) end
---@return string|nil digest, string? message, string? code  64 hex characters
function Manifest:finish() end
---@return integer
function Manifest:count() end
---@return number
function Manifest:bytes() end
function Manifest:close() end

---@class wsync.shm.native
local shm_native = {}
---@param bytes integer
---@return wsync.Shm|nil buffer, string? message, string? code
function shm_native.create(bytes) end
---@param name string
---@return wsync.Shm|nil buffer, string? message, string? code
function shm_native.open(name) end

---@class wsync.Shm
local Shm = {}
---@return string
function Shm:name() end
---@return integer
function Shm:size() end
---@return boolean
function Shm:is_owner() end
---@return lightuserdata
function Shm:pointer() end
---@param offset integer
---@param bytes string
function Shm:write(offset, bytes) end
---@param offset integer
---@param length integer
---@return string
function Shm:read(offset, length) end
---@return true|nil ok, string? message, string? code
function Shm:unlink() end
---@return true|nil ok, string? message, string? code
function Shm:close() end

---@class wsync.DeviceInfo
---@field index integer
---@field uuid string        lowercase 8-4-4-4-12
---@field name string
---@field total_bytes number
---@field free_bytes number

---@class wsync.device.native
local device_native = {}
---@param backend "host"|"cuda"
---@return integer|nil count, string? message, string? code
function device_native.count(backend) end
---@param backend "host"|"cuda"
---@param index integer
---@return wsync.DeviceInfo|nil info, string? message, string? code
function device_native.query(backend, index) end
