---@meta wsync._host
-- LuaCATS stubs for `wsync._host` (bindings/embed/l_host.c): the embedding
-- host's services to its scripts. Not loaded at run time; read by the Lua
-- language server. tests/bindings/meta_spec.lua checks the stubs.

---@class wsync._host
local host = {}

--- SIGINT raises "interrupted" in running Lua code until disarmed.
function host.arm_interrupt() end

--- Undoes this host's arm_interrupt (another host's arm is left alone).
function host.disarm_interrupt() end

---@param handler fun(err: any)?  receives errors thrown in libuv callbacks
function host.set_callback_error_handler(handler) end

---@return string? root  the scripts directory, or nil for embedded bytecode
function host.script_root() end

---@return string[] modules  names of the embedded Lua modules
function host.embedded_modules() end

--- Raises the exit sentinel (a table whose metatable is named "wsync exit");
--- installed as os.exit.
---@param code integer|boolean?
function host.exit(code) end

---@return integer pid
function host.pid() end

--- The message handler the host uses for protected calls (adds tracebacks).
---@param err any
---@return any err
function host.message_handler(err) end

return host
