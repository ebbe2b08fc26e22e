---@meta wsync._device
-- LuaCATS stubs for `wsync._device` (bindings/l_device.c): device identity
-- and memory per backend. Not loaded at run time; read by the Lua language
-- server. tests/bindings/meta_spec.lua checks the stubs.

---@class wsync.DeviceInfo
---@field index integer
---@field uuid string        lowercase 8-4-4-4-12
---@field name string
---@field total_bytes number
---@field free_bytes number

---@class wsync._device
local device = {}

---@param backend "host"|"cuda"
---@return integer|nil count, string? message, string? code
function device.count(backend) end

---@param backend "host"|"cuda"
---@param index integer
---@return wsync.DeviceInfo|nil info, string? message, string? code
function device.query(backend, index) end

return device
