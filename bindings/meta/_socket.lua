---@meta wsync._socket
-- LuaCATS stubs for `wsync._socket` (bindings/l_socket.c): peer credentials
-- of unix-socket connections. Not loaded at run time; read by the Lua
-- language server. tests/bindings/meta_spec.lua checks the stubs.

---@class wsync._socket
local socket = {}

--- The credentials of the process on the other end of a connected unix socket.
---@param fd integer
---@return integer|nil uid, integer|string pid_or_message, string? code
function socket.peer(fd) end

---@return integer uid  this process's user id
function socket.own_uid() end

return socket
