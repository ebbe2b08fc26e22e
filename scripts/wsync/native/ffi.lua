--- The C core through LuaJIT's FFI: `require("wsync.native.ffi")` declares the core's
--- functions and types once per process and returns the namespace to call them in.
---
--- The core's functions come from the table that `wsync._core.api` points to, not from
--- the process's symbols: libwsync exports only the API of wsync.h, so ffi.C finds the
--- core in the `wsync` binary but not in a trainer that embeds libwsync. Anything else
--- (enum constants, the C library) comes from ffi.C.
local ffi = require("ffi")
local core = require("wsync._core")

-- busted reloads modules between spec files; ffi.cdef must run only once.
if not pcall(ffi.typeof, "ws_core_api") then
  ffi.cdef(core.cdef)
end

local functions = ffi.cast("const ws_core_api *", core.api)

local function core_function(name)
  return functions[name]
end

return setmetatable({}, {
  __index = function(self, name)
    local found, value = pcall(core_function, name)
    if not found then
      value = ffi.C[name]
    end
    rawset(self, name, value)
    return value
  end,
})
