--- The C library's standard streams, where Lua's io library cannot tell.
local ffi = require("ffi")

local M = {}

-- libc's stdout and its error flag. (busted reloads modules between spec
-- files; a second cdef of the same names fails harmlessly.)
pcall(ffi.cdef, "int ferror(void *stream);")
pcall(ffi.cdef, "extern void *stdout;")

--- Whether a write to standard output has failed since the process started
--- (the wsync binary ignores SIGPIPE, libwsync blocks it while its code runs in
--- a trainer: a reader that left shows as EPIPE). It asks the
--- stream's sticky error flag, not io.stdout:flush(), whose result cannot be
--- trusted: LuaJIT compiles flush() into fflush() plus a guard, a failed
--- guard leaves the trace before the call, and the interpreter then flushes
--- again, finds the buffer empty (glibc dropped it on EPIPE) and returns true.
---@return boolean
function M.stdout_failed()
  return ffi.C.ferror(ffi.C.stdout) ~= 0
end

return M
