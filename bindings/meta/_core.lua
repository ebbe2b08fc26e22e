---@meta wsync._core
-- LuaCATS stubs for `wsync._core` (bindings/l_core.c). Not loaded at run time;
-- read by the Lua language server. tests/bindings/meta_spec.lua checks that
-- every function the module registers has a stub here.

---@class wsync._core
---@field version string          wsync version ("0.1.0")
---@field status table<string, integer>  status codes by name (OK = 0, EINVAL = -1, ...)
---@field cuda_built boolean      the binary carries the cuda backend
---@field cuda_version string?    the CUDA toolkit it was built with (nil without the cuda backend)
---@field nccl_built boolean      the binary carries the NCCL path (loaded at run time)
---@field commit string           the commit it was built from ("-dirty": changed files; "unknown" outside git)
---@field build_type string       CMake's build type ("RelWithDebInfo", ...)
---@field cdef string             the C core's declarations for ffi.cdef (with the type ws_core_api)
---@field api lightuserdata       the core's function table (`const ws_core_api *` once cast)
---@field image string?           the file holding this code: the wsync binary, or libwsync.so when embedded
local core = {}

---@param code integer
---@return string name  e.g. "EINVAL"; "EUNKNOWN" for an unknown code
function core.status_name(code) end

---@param code integer
---@return string message
function core.status_message(code) end

return core
