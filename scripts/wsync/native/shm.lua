--- Shared-memory buffers of the host backend. `create(bytes)` makes and maps a
--- private segment whose name `buffer:name()` another process passes to
--- `open(name)`. `anonymous(bytes)` maps private memory that no other process
--- can open. `buffer:close()` unmaps (and unlinks when it created it).
local native = require("wsync._shm")

return {
  create = native.create,
  open = native.open,
  anonymous = native.anonymous,
}
