--- Device identity and memory. `query(backend, index)` returns
--- `{index, uuid, name, total_bytes, free_bytes}` or nil, message, code;
--- `count(backend)` the number of devices. Backends: "host", "cuda".
--- `gpu_memory(uuid)`: a GPU's memory as its driver sees it (NVML: asking
--- makes no CUDA context), `{total_bytes, used_bytes, free_bytes,
--- processes = {{pid, used_bytes}}}`, or nil, message, code.
local native = require("wsync._device")

return {
  count = native.count,
  query = native.query,
  gpu_memory = native.gpu_memory,
}
