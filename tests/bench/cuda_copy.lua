-- Benchmark: the batched copy kernel over a Qwen3-30B-A3B-shaped op list
-- against flat device copies of the same bytes, measured in one run on one
-- GPU.
--
--   wsync tests/bench/cuda_copy.lua [SCALE] [REPEATS] [CHUNK_MIB] [DEVICE] [CONFIG_JSON] [TILES]
--       SCALE        fraction of the model's bytes to move (default 1: the
--                    full 61.06 GB, which needs two buffers of that size);
--                    each tensor's bytes are scaled and rounded to whole
--                    bfloat16 elements, the op count stays 18,867
--       REPEATS      timed runs of each copy (default 10), after one warm-up
--       CHUNK_MIB    packed-buffer size for the chunked plans (default 1024)
--       DEVICE       CUDA device index (default 0)
--       CONFIG_JSON  a Hugging Face config.json of another Qwen3-MoE (default
--                    the qwen3-30b-a3b preset, the values of
--                    ../shared/reference/qwen3_moe/qwen3-30b-a3b.json; "-"
--                    for the default when TILES follows)
--       TILES        tile sizes in bytes for the tiled layout's rows (warps
--                    take tiles of the copy stream in turn; default
--                    8192,65536; "none" for no tiled rows)
--
-- The ops: every canonical tensor of the model's export plan (18,867 for the
-- 30B-A3B), one contiguous op each, from a source buffer laid out as the
-- trainer's tensors back to back into a target laid out as the packed stream.
-- Measured, each with events on one stream (best and median of REPEATS):
--   floor: one cudaMemcpyAsync device to device of all the bytes (the copy
--          engine), and the kernel with one contiguous op of all the bytes;
--   the kernel with every op in one launch (one plan);
--   the kernel with one plan per CHUNK_MIB chunk, launched back to back
--          (what a publication does: launches grow with chunks, not tensors);
--   the same three (one contiguous op, one launch, chunk plans) with each
--          tiled layout of TILES;
--   the GPU synthetic fill of the same bytes (the synthetic trainer's values).
-- Rates count bytes read plus written (2 x bytes / time), like DESIGN.md's
-- 4.3 TB/s. "vs floor" is the faster floor's time over the row's time.
local ffi = require("ffi")
local uv = require("luv")
local cuda = require("wsync._cuda")
local device = require("wsync._device")

local function require_first(...)
  for _, name in ipairs({ ... }) do
    local ok, module = pcall(require, name)
    if ok then
      return module
    end
  end
  error("none of these modules loads: " .. table.concat({ ... }, ", "))
end

require_first("wsync.native.ffi", "wsync.ffi") -- declares ws_cuda_copy_op for ffi.new
local qwen3_moe = require_first("wsync.plan.qwen3_moe", "wsync.models.qwen3_moe")

local scale = tonumber(arg and arg[1]) or 1
local repeats = math.max(1, math.floor(tonumber(arg and arg[2]) or 10))
local chunk_bytes = math.floor((tonumber(arg and arg[3]) or 1024) * 1024 * 1024)
local index = math.floor(tonumber(arg and arg[4]) or 0)
local config_path = arg and arg[5] ~= "-" and arg[5] or nil
local tiles = {}
for value in ((arg and arg[6]) or "8192,65536"):gmatch("[^,]+") do
  if value ~= "none" then
    tiles[#tiles + 1] = tonumber(value) or error("cuda_copy: tile '" .. value .. "' is no number of bytes")
  end
end

local function fail(message)
  io.stderr:write("cuda_copy: ", message, "\n")
  os.exit(1)
end

local function model_config()
  if not config_path then
    return qwen3_moe.config("qwen3-30b-a3b"), "qwen3-30b-a3b preset"
  end
  local file = assert(io.open(config_path, "r"))
  local text = file:read("*a")
  file:close()
  return qwen3_moe.config(require("cjson").decode(text)), config_path
end

local function median(values)
  local sorted = { unpack(values) }
  table.sort(sorted)
  local n = #sorted
  return n % 2 == 1 and sorted[(n + 1) / 2] or (sorted[n / 2] + sorted[n / 2 + 1]) / 2
end

local function check(ok, message, code)
  if not ok then
    fail(tostring(message) .. " (" .. tostring(code) .. ")")
  end
  return ok
end

local info, why = device.query("cuda", index)
if not info then
  fail("no CUDA device " .. index .. ": " .. tostring(why))
end

-- The op list: every canonical tensor, its bytes scaled.
local config, config_name = model_config()
local canonical = qwen3_moe.canonical(config)
local sizes, total = {}, 0
for i, tensor in ipairs(canonical) do
  local bytes = math.max(2, math.floor(tensor.bytes * scale / 2 + 0.5) * 2)
  sizes[i] = bytes
  total = total + bytes
end
local needed = 2 * total + 2 * 1024 * 1024 * 1024
if needed > info.free_bytes then
  fail(string.format("the source and target need %.2f GB and device %d has %.2f GB free: pass a SCALE below %.3f",
    needed / 1e9, index, info.free_bytes / 1e9, scale * info.free_bytes / needed))
end

-- ws_cuda_copy_op records for ops [first, last], packed (regions from 0:
-- 0 the target, 1 the source).
local function packed_ops(first, last, offsets)
  local ops = ffi.new("ws_cuda_copy_op[?]", last - first + 1)
  for i = first, last do
    local op = ops[i - first]
    op.target_region, op.source_region = 0, 1
    op.target_offset, op.source_offset = offsets[i], offsets[i]
    op.rows, op.width = 1, sizes[i]
    op.target_pitch, op.source_pitch = sizes[i], sizes[i]
  end
  return ffi.string(ops, ffi.sizeof(ops))
end

local offsets, at = {}, 0
for i = 1, #sizes do
  offsets[i] = at
  at = at + sizes[i]
end

local stream = check(cuda.stream(index))
local source = check(cuda.buffer(index, total))
local target = check(cuda.buffer(index, total))
local start, stop = check(cuda.event(index, true)), check(cuda.event(index, true))
local regions = { target, source }

-- Real values in the source (bfloat16 synthetic values), generated on the GPU.
local generate = check(cuda.synth_plan(index, { source }, { { region = 1, name = "source", elements = total / 2 } }))

-- Seconds of each timed run of `queue()` (queued between the two events).
local function time(queue)
  queue()
  check(stream:synchronize())
  local seconds = {}
  for i = 1, repeats do
    check(start:record(stream))
    queue()
    check(stop:record(stream))
    check(stop:synchronize())
    seconds[i] = check(stop:elapsed(start)) / 1000
  end
  return seconds
end

local built_started = uv.hrtime()
local one_plan = check(cuda.copy_plan(index, regions, packed_ops(1, #sizes, offsets)))
local built_seconds = (uv.hrtime() - built_started) / 1e9
local one_info = one_plan:info()

-- One plan per CHUNK_MIB chunk (`options`: copy_plan's).
local function chunk_plans_of(options)
  local plans, first = {}, 1
  while first <= #sizes do
    local last, bytes = first, sizes[first]
    while last < #sizes and bytes + sizes[last + 1] <= chunk_bytes do
      last = last + 1
      bytes = bytes + sizes[last]
    end
    plans[#plans + 1] = check(cuda.copy_plan(index, regions, packed_ops(first, last, offsets), options))
    first = last + 1
  end
  return plans
end

local chunk_started = uv.hrtime()
local chunk_plans = chunk_plans_of(nil)
local chunk_seconds = (uv.hrtime() - chunk_started) / 1e9
local flat = check(cuda.copy_plan(index, regions, { { target = 1, source = 2, width = total } }))
local all_plans = { one_plan, flat }
for _, plan in ipairs(chunk_plans) do
  all_plans[#all_plans + 1] = plan
end

local function launches(plans)
  return function()
    for _, plan in ipairs(plans) do
      check(plan:launch(stream))
    end
  end
end

local rows = {
  { "cudaMemcpyAsync, one copy (floor)", function()
    check(cuda.memcpy(target, 0, source, 0, total, stream))
  end },
  { "kernel, one contiguous op (floor)", function()
    check(flat:launch(stream))
  end },
  { string.format("kernel, %d ops in one launch", #sizes), function()
    check(one_plan:launch(stream))
  end },
  { string.format("kernel, %d chunk plans of %d MiB", #chunk_plans, chunk_bytes / 1024 / 1024), function()
    for _, plan in ipairs(chunk_plans) do
      check(plan:launch(stream))
    end
  end },
  { "GPU synthetic fill (bfloat16, writes only)", function()
    check(generate:fill(1, stream))
  end, 1 },
}
for _, tile in ipairs(tiles) do
  local options = { tile = tile }
  local label = tile % 1024 == 0 and string.format("%d KiB", tile / 1024) or string.format("%d B", tile)
  local tiled = {
    flat = check(cuda.copy_plan(index, regions, { { target = 1, source = 2, width = total } }, options)),
    one = check(cuda.copy_plan(index, regions, packed_ops(1, #sizes, offsets), options)),
    chunks = chunk_plans_of(options),
  }
  for _, plan in ipairs({ tiled.flat, tiled.one, unpack(tiled.chunks) }) do
    all_plans[#all_plans + 1] = plan
  end
  rows[#rows + 1] = { string.format("tiles of %s, one contiguous op", label), launches({ tiled.flat }) }
  rows[#rows + 1] = { string.format("tiles of %s, %d ops in one launch", label, #sizes), launches({ tiled.one }) }
  rows[#rows + 1] = { string.format("tiles of %s, %d chunk plans", label, #tiled.chunks), launches(tiled.chunks) }
end

check(generate:fill(1, stream))
check(stream:synchronize())

print(string.format("cuda_copy: %s (device %d, %.1f GiB, %.1f GiB free)", info.name, index,
  info.total_bytes / 2 ^ 30, info.free_bytes / 2 ^ 30))
print(string.format("model: %s, %d canonical tensors, %.3f GB x scale %g = %.3f GB moved per copy", config_name,
  #canonical, qwen3_moe.counts(config).bytes / 1e9, scale, total / 1e9))
print(string.format("one plan: %d descriptors over %d warps (%d blocks), %.1f MiB on the device, built in %.1f ms",
  one_info.pieces, one_info.warps, one_info.blocks, one_info.device_bytes / 2 ^ 20, built_seconds * 1e3))
print(string.format("chunk plans: %d, built in %.1f ms; %d timed runs each after one warm-up", #chunk_plans,
  chunk_seconds * 1e3, repeats))
print()
print(string.format("| %-44s | %10s | %10s | %12s | %8s |", "copy", "best ms", "median ms", "TB/s (r+w)", "vs floor"))
print(string.format("| %s | %s | %s | %s | %s |", string.rep("-", 44), string.rep("-", 10), string.rep("-", 10),
  string.rep("-", 12), string.rep("-", 8)))
local results, floor = {}, math.huge
for i, row in ipairs(rows) do
  local seconds = time(row[2])
  results[i] = { best = math.min(unpack(seconds)), median = median(seconds) }
  if i <= 2 then
    floor = math.min(floor, results[i].best)
  end
end
for i, row in ipairs(rows) do
  local moved = (row[3] or 2) * total
  print(string.format("| %-44s | %10.3f | %10.3f | %12.3f | %8.3f |", row[1], results[i].best * 1e3,
    results[i].median * 1e3, moved / results[i].best / 1e12, floor / results[i].best))
end
print()
print(string.format("ratio: %d ops in one launch take %.3fx the floor's time (best against best), %d chunk plans %.3fx",
  #sizes, results[3].best / floor, #chunk_plans, results[4].best / floor))

for _, plan in ipairs(all_plans) do
  check(plan:close())
end
for _, object in ipairs({ generate, start, stop, source, target, stream }) do
  check(object:close())
end
