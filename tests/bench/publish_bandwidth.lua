-- Benchmark: host-backend publication bandwidth against memcpy bandwidth,
-- measured in one run; or, with `layout`, the host's cost per publication
-- outside the copies at the tensor counts of the real models.
--
--   wsync tests/bench/publish_bandwidth.lua layout [30b|235b|both] [PUBLICATIONS]
--       the Qwen3-30B-A3B layout (48 layers x 128 experts: 531 trainer
--       tensors, 18,867 canonical) and the Qwen3-235B-A22B one (94 layers:
--       36,945 canonical), with tiny dims so that the bytes fit this machine
--       (hidden 32, moe_intermediate 4, vocabulary 512); FSDP2 -> TP2, one
--       chunk, `publish` alone in the schedule. Per publication after the
--       first: the total time, the copies' own time (the slowest rank's fill
--       and the slowest TP worker's load per chunk, as they report them), and
--       the rest: the control plane and every per-tensor cost of the host,
--       the agents and the workers. The last line is
--       `host time outside copies: X ms per publication at N tensors`.
--   wsync tests/bench/publish_bandwidth.lua [GB] [BUFFER_MIB] [PUBLICATIONS]
--       GB           model size to aim for, in 10^9 bytes (default 2.5)
--       BUFFER_MIB   packed buffer size (default 256)
--       PUBLICATIONS model versions to publish (default 4)
--
-- (a) memcpy: one thread copies a buffer of the model's size into another
--     (both wsync.native.shm.anonymous, written before timing), with glibc's memcpy
--     and with the C core's ws_copy_run given one contiguous op; several
--     repetitions, best and median; the faster of the two is the reference.
-- (b) publication: a Qwen3-MoE-shaped config of that size (hidden 1024, 32
--     experts of 512, vocabulary 32000, as many layers as the size needs)
--     published by two synthetic FSDP trainer ranks into a TP2 reference
--     runtime through shared-memory packed buffers, in-process through
--     wsync.publish.session with a generated recipe (schedule: publish only, verify
--     off). Prints, per publication, the phases, model bytes/s, and moved
--     bytes/s (every byte the data path copies: the fill writes each rank's
--     shard into every rank's buffer, TP world x model bytes; the load copies
--     each TP slice into resident storage, about the model bytes).
-- The ratio: steady-state publication bytes/s (publications after the first,
-- whose time includes creating and mapping the buffers and backing the
-- resident weights) over the reference, best against best and median against
-- median; the target is 50%.
local ffi = require("ffi")
local uv = require("luv")
local C = require("wsync.native.ffi")
local qwen3_moe = require("wsync.plan.qwen3_moe")
local recipe_module = require("wsync.recipe")
local schema = require("wsync.recipe.schema")
local session = require("wsync.publish.session")
local shm = require("wsync.native.shm")

-- glibc's memcpy, called with a size_t length: ffi.copy converts its length
-- to an int32 and would copy 2 GiB of a larger buffer. (pcall: a second
-- declaration in one process raises.)
pcall(ffi.cdef, "void *memcpy(void *, const void *, size_t);")

local TARGET_RATIO = 0.5
local MEMCPY_REPETITIONS = 5

local layout_mode = arg and arg[1] == "layout"
local target_gb = tonumber(arg and arg[1]) or 2.5
local buffer_bytes = math.floor((tonumber(arg and arg[2]) or 256) * 1024 * 1024)
local publications = tonumber(arg and arg[3]) or 4
if layout_mode then
  publications = tonumber(arg[3]) or 8
end

local function read_file(path)
  local file = io.open(path, "r")
  if not file then
    return ""
  end
  local text = file:read("*a")
  file:close()
  return text
end

local function machine()
  local cpuinfo = read_file("/proc/cpuinfo")
  local model = cpuinfo:match("model name%s*:%s*([^\n]+)") or "unknown CPU"
  local total_kib = tonumber(read_file("/proc/meminfo"):match("MemTotal:%s*(%d+)")) or 0
  local load = { uv.loadavg() }
  return string.format("%d CPUs (%s), %.1f GiB memory, load average %.2f %.2f %.2f", #uv.cpu_info(), model,
    total_kib / 1024 / 1024, load[1], load[2], load[3])
end

local function gbps(bytes, seconds)
  return bytes / seconds / 1e9
end

local function median(values)
  local sorted = { unpack(values) }
  table.sort(sorted)
  local n = #sorted
  return n % 2 == 1 and sorted[(n + 1) / 2] or (sorted[n / 2] + sorted[n / 2 + 1]) / 2
end

local function best(values)
  return math.min(unpack(values))
end

-- The benchmark's model: Qwen3-MoE proportions at a size of about `gb`.
local function model_config(gb)
  local config = {
    vocab_size = 32000, hidden_size = 1024, moe_intermediate_size = 512, num_hidden_layers = 1,
    num_attention_heads = 16, num_key_value_heads = 4, head_dim = 64, num_experts = 32,
    tie_word_embeddings = false,
  }
  local one = qwen3_moe.counts(qwen3_moe.config(config)).bytes
  config.num_hidden_layers = 2
  local per_layer = qwen3_moe.counts(qwen3_moe.config(config)).bytes - one
  config.num_hidden_layers = math.max(1, math.floor((gb * 1e9 - (one - per_layer)) / per_layer + 0.5))
  return config, qwen3_moe.counts(qwen3_moe.config(config)).bytes
end

-- (a) Single-thread copies between two buffers of `bytes`: glibc's memcpy
-- and the C core's ws_copy_run with one contiguous op. Returns the
-- seconds of each repetition, by method.
local function memcpy_bandwidth(bytes)
  local source = assert(shm.anonymous(bytes))
  local target = assert(shm.anonymous(bytes))
  local source_pointer, target_pointer = source:pointer(), target:pointer()
  local op = ffi.new("ws_copy_op[1]")
  local function copy_run(to, from, to_offset, from_offset, length)
    op[0].target_offset, op[0].source_offset = to_offset, from_offset
    op[0].rows, op[0].width = 1, length
    op[0].target_pitch, op[0].source_pitch = length, length
    assert(C.ws_copy_run(to, bytes, from, bytes, op, 1) == 0, ffi.string(C.ws_error_detail()))
  end
  -- Real bytes in the source (untouched anonymous pages would all read the
  -- shared zero page): a 1 MiB pattern, doubled in place.
  local block = {}
  for i = 0, 1023 do
    block[#block + 1] = string.char((i * 131 + 7) % 256)
  end
  local pattern = table.concat(block):rep(1024)
  source:write(0, pattern:sub(1, math.min(#pattern, bytes)))
  local filled = math.min(#pattern, bytes)
  while filled < bytes do
    local length = math.min(filled, bytes - filled)
    copy_run(source_pointer, source_pointer, filled, 0, length)
    filled = filled + length
  end
  copy_run(target_pointer, source_pointer, 0, 0, bytes) -- faults the target in
  local methods = {
    memcpy = function()
      ffi.C.memcpy(target_pointer, source_pointer, bytes)
    end,
    ws_copy_run = function()
      copy_run(target_pointer, source_pointer, 0, 0, bytes)
    end,
  }
  local seconds = { memcpy = {}, ws_copy_run = {} }
  for i = 1, MEMCPY_REPETITIONS do
    for _, name in ipairs({ "memcpy", "ws_copy_run" }) do
      local started = uv.hrtime()
      methods[name]()
      seconds[name][i] = (uv.hrtime() - started) / 1e9
    end
  end
  source:close()
  target:close()
  return seconds
end

-- (b) Publications through an in-process session.
local function publish(config, count)
  local definition = {
    name = "publish-bandwidth",
    description = "benchmark: FSDP2 -> TP2 Qwen3-MoE-shaped model, host backend",
    backend = "host",
    model = { family = "qwen3_moe", config = config },
    trainer = { kind = "synthetic", ranks = 2, steps = count or publications },
    runtime = { kind = "reference", tp = 2 },
    buffers = { bytes = buffer_bytes, count = 2 },
    memory = { device_bytes = 1024 * 1024 * 1024 * 1024, kv_bytes = 0 },
    schedule = { "publish" },
    timeouts = { startup = 120, init = 600, fill = 600, load_chunk = 600, finish_update = 600 },
    verify = false,
  }
  local recipe, failure = schema.check(recipe_module.schema, definition)
  assert(recipe, failure and string.format("generated recipe, field %s: %s", failure.path, failure.message))
  recipe.path = "(generated by tests/bench/publish_bandwidth.lua)"
  return session.run(recipe)
end

local function moved_bytes(report, tp_world)
  local loaded = 0
  for _, receipt in ipairs(report.receipts) do
    loaded = loaded + receipt.bytes
  end
  return tp_world * report.bytes + loaded, loaded
end

local function median_of(reports, key)
  local values = {}
  for index = 2, #reports do
    values[#values + 1] = key(reports[index])
  end
  return median(values)
end

-- The layout of a real model's tensor counts with tiny dims.
local function layout_config(layers)
  return {
    vocab_size = 512, hidden_size = 32, moe_intermediate_size = 4, num_hidden_layers = layers,
    num_attention_heads = 4, num_key_value_heads = 2, head_dim = 8, num_experts = 128, tie_word_embeddings = false,
  }
end

if layout_mode then
  print(string.format("publish host cost: machine %s", machine()))
  local which = arg[2] or "both"
  local layouts = {}
  if which == "30b" or which == "both" then
    layouts[#layouts + 1] = { name = "Qwen3-30B-A3B layout", layers = 48 }
  end
  if which == "235b" or which == "both" then
    layouts[#layouts + 1] = { name = "Qwen3-235B-A22B layout", layers = 94 }
  end
  local lines = {}
  for _, layout in ipairs(layouts) do
    local config = layout_config(layout.layers)
    local counts = qwen3_moe.counts(qwen3_moe.config(config))
    buffer_bytes = 1
    while buffer_bytes < counts.bytes do
      buffer_bytes = buffer_bytes * 2
    end
    local reports = publish(config, publications)
    local total = median_of(reports, function(r)
      return r.timings.total
    end)
    local copies = median_of(reports, function(r)
      return (r.timings.fill_copy or 0) + (r.timings.load_copy or 0)
    end)
    local outside = median_of(reports, function(r)
      return r.timings.total - (r.timings.fill_copy or 0) - (r.timings.load_copy or 0)
    end)
    print(string.format("%s: %d trainer tensors, %d canonical, %.1f MB, %d chunk(s); %d publications, median of "
      .. "2..%d: total %.2f ms, copies %.2f ms, outside copies %.2f ms (%.1f us per canonical tensor)", layout.name,
      #qwen3_moe.trainer_layout(qwen3_moe.config(config)), counts.tensors, counts.bytes / 1e6, reports[1].chunks,
      #reports, #reports, total * 1e3, copies * 1e3, outside * 1e3, outside * 1e6 / counts.tensors))
    lines[#lines + 1] = string.format("host time outside copies: %.2f ms per publication at %d tensors", outside * 1e3,
      counts.tensors)
  end
  for _, line in ipairs(lines) do
    print(line)
  end
  return
end

local config, model_bytes = model_config(target_gb)
print(string.format("publish bandwidth: machine %s", machine()))
print(string.format("model: Qwen3-MoE-shaped, %d layers x %d experts (hidden %d, moe_intermediate %d, vocab %d), "
  .. "%.3f GB; buffers 2 x %d MiB; %d publications", config.num_hidden_layers, config.num_experts,
  config.hidden_size, config.moe_intermediate_size, config.vocab_size, model_bytes / 1e9,
  buffer_bytes / 1024 / 1024, publications))

-- The reference: the faster of the two single-thread copies, best repetition
-- (and, for the median ratio, the faster median).
local copy_seconds = memcpy_bandwidth(model_bytes)
local memcpy_best, memcpy_median = 0, 0
for _, name in ipairs({ "memcpy", "ws_copy_run" }) do
  local seconds = copy_seconds[name]
  local rate = gbps(model_bytes, best(seconds))
  memcpy_best = math.max(memcpy_best, rate)
  memcpy_median = math.max(memcpy_median, gbps(model_bytes, median(seconds)))
  print(string.format("%-11s 1 thread, %.3f GB, %d repetitions: best %.2f GB/s (%.1f ms), median %.2f GB/s", name,
    model_bytes / 1e9, #seconds, rate, best(seconds) * 1e3, gbps(model_bytes, median(seconds))))
end
print(string.format("reference copy bandwidth (faster of both): best %.2f GB/s, median %.2f GB/s", memcpy_best,
  memcpy_median))

local reports = publish(config)
print(string.format("%-4s %9s %8s %8s %8s %8s %8s %8s %8s %10s %10s", "pub", "total ms", "init", "start",
  "chunks", "fill", "load", "verify", "finish", "model GB/s", "moved GB/s"))
local steady = {}
for index, report in ipairs(reports) do
  local t = report.timings
  local moved, loaded = moved_bytes(report, 2)
  report.moved, report.loaded = moved, loaded
  print(string.format("%-4d %9.1f %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f %10.2f %10.2f", index, t.total * 1e3,
    t.init * 1e3, t.start * 1e3, t.chunks * 1e3, t.fill * 1e3, t.load * 1e3, t.verify * 1e3, t.finish * 1e3,
    gbps(report.bytes, t.total), gbps(moved, t.total)))
  if index > 1 or #reports == 1 then
    steady[#steady + 1] = t.total
  end
end
local last = reports[#reports]
print(string.format("per publication: %d chunks; moved %.3f GB = fill %.3f GB (2 ranks x model) + load %.3f GB",
  last.chunks, last.moved / 1e9, 2 * last.bytes / 1e9, last.loaded / 1e9))
local publication_rate = gbps(model_bytes, best(steady))
local ratio = publication_rate / memcpy_best
local median_ratio = gbps(model_bytes, median(steady)) / memcpy_median
print(string.format("steady state (publications 2..%d): best %.1f ms = %.2f GB/s model, %.2f GB/s moved; "
  .. "median %.1f ms = %.2f GB/s model", #reports, best(steady) * 1e3, publication_rate,
  gbps(last.moved, best(steady)), median(steady) * 1e3, gbps(model_bytes, median(steady))))
print(string.format("publication GB/s / memcpy GB/s: best %.2f, median %.2f (target >= %.2f: %s); "
  .. "moved GB/s / memcpy GB/s: %.2f; first publication / memcpy: %.2f", ratio, median_ratio, TARGET_RATIO,
  ratio >= TARGET_RATIO and "met" or "NOT met", gbps(last.moved, best(steady)) / memcpy_best,
  gbps(model_bytes, reports[1].timings.total) / memcpy_best))
