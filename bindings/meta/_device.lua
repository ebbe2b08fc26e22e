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

---@class wsync.GpuProcess
---@field pid integer        as the driver knows it (another pid namespace's, in a container)
---@field used_bytes number? nil where the driver does not say

---@class wsync.GpuMemory
---@field total_bytes number  what processes can hold (the driver's reserve left out where NVML names it)
---@field used_bytes number  total less free
---@field free_bytes number
---@field reserved_bytes number  the driver's own (0: not named by this NVML; total and used then count it)
---@field processes wsync.GpuProcess[]? nil where NVML could not list them

---@class wsync._device
local device = {}

---@param backend "host"|"cuda"
---@return integer|nil count, string? message, string? code
function device.count(backend) end

---@param backend "host"|"cuda"
---@param index integer
---@return wsync.DeviceInfo|nil info, string? message, string? code
function device.query(backend, index) end

--- The GPU's memory as its driver sees it (NVML, no CUDA context made).
---@param uuid string  lowercase 8-4-4-4-12
---@return wsync.GpuMemory|nil memory, string? message, string? code
function device.gpu_memory(uuid) end

return device
