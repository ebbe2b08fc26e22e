--- The C core through LuaJIT's FFI: `require("wsync.native.ffi")` declares the core's
--- functions and types once per process and returns `ffi.C`.
local ffi = require("ffi")

-- busted reloads modules between spec files; ffi.cdef must run only once.
if not pcall(ffi.typeof, "ws_manifest") then
  ffi.cdef(require("wsync._core").cdef)
end

return ffi.C
