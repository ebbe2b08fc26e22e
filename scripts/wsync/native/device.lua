--- Device identity and memory. `query(backend, index)` returns
--- `{index, uuid, name, total_bytes, free_bytes}` or nil, message, code;
--- `count(backend)` the number of devices. Backends: "host", "cuda".
local native = require("wsync._device")

return {
  count = native.count,
  query = native.query,
}
