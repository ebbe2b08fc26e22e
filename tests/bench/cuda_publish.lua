-- Benchmark: whole publications of the full Qwen3-30B-A3B shape on one GPU
-- (cuda backend, trainer world 1, TP1: tests/fixtures/recipes/cuda_30b.lua),
-- against the floors measured in the same run.
--
--   wsync tests/bench/cuda_publish.lua [BUFFER_GIB|direct,...] [PUBLICATIONS] [RECIPE]
--       BUFFER_GIB    packed-buffer sizes to try, two buffers each (NxGIB:
--                     N buffers of GIB each), and
--                     `direct`: no packed buffers, the TP worker reading the
--                     trainer's exported storage (one allocation), and
--                     `direct-tensor`: the same with one allocation per
--                     trainer tensor, as a PyTorch trainer's (default
--                     4,8,direct,direct-tensor); `serial:SIZE` moves SIZE's
--                     chunks one side at a time (fill k, then load k), to
--                     time each copy alone; `device:SIZE` orders its chunks
--                     on the device (buffers.order = "device": fills and loads
--                     queued at once, each waiting on the device for the
--                     other; the fill and load columns are then the time to
--                     queue them, the last load's the wait for all);
--                     `SIZE@TILE` gives its copy plans tiles of TILE bytes
--                     ($WSYNC_CUDA_COPY_TILE; the default 64 KiB; 0: each warp
--                     its own range)
--       PUBLICATIONS  per size (default 5); the first of each (plans made,
--                     buffers mapped, resident storage allocated) is left
--                     out of the medians
--       RECIPE        default tests/fixtures/recipes/cuda_30b.lua (also:
--                     cuda_235b_layers.lua, the first 12 layers of the 235B)
--
-- Floors, before the sessions (the same bytes, 61.06 GB): one flat
-- cudaMemcpyAsync device to device (best of 5), and the packed path's,
-- twice that (pack into the buffers, then unpack). Per buffer size: the
-- chunk count, the median total, its fill and load phases (they overlap,
-- double-buffered), the copies' own device time, and the ratio of the total
-- to the packed path's floor. Every publication's resident slices are
-- checked on the device after it, outside the timed publication. After the
-- table, the fastest publication of each size chunk by chunk: when its fill
-- and its load were asked for and answered, against their copies' own time
-- (the rest of each request is control: the trip to the rank or the TP
-- worker and back, and waiting for the stream).
package.path = "./?.lua;" .. package.path
local cuda = require("wsync._cuda")
local loop = require("wsync.loop")
local uv = require("luv")
local recipe_module = require("wsync.recipe")
local session = require("wsync.publish.session")

local sizes, counts, serial = {}, {}, {} -- (counts: buffers per size, serial: one side at a time, by index)
local tiles, ordered = {}, {} -- (by index: $WSYNC_CUDA_COPY_TILE for that size's processes; buffers.order)
for token in (arg[1] or "4,8,direct,direct-tensor"):gmatch("[%w%.%-:@]+") do
  local value = token:match("^serial:(.+)$") or token
  serial[#sizes + 1] = value ~= token
  local on_device = value:match("^device:(.+)$")
  value, ordered[#sizes + 1] = on_device or value, on_device ~= nil
  local untiled, tile = value:match("^(.-)@(%d+)$")
  value, tiles[#sizes + 1] = untiled or value, tile
  local count, gib = value:match("^(%d+)x([%d.]+)$")
  local size = (value == "direct" or value == "direct-tensor") and value or tonumber(gib or value)
  if not size then
    io.stderr:write("cuda_publish: '", value, "' is no buffer size in GiB (GIB or NxGIB), direct or direct-tensor\n")
    os.exit(2)
  end
  sizes[#sizes + 1] = size
  counts[#sizes] = tonumber(count) or 2
end
-- Chunk by chunk, the publication `report`'s trace, in ms since it started.
local function print_trace(label, report)
  local trace = report.trace or {}
  print(string.format("%s, publication of version %d (%.1f ms): per chunk, fill and load asked -> answered "
    .. "(copy), ms", label, report.model_version, report.timings.total * 1e3))
  local control = { fill = 0, load = 0 }
  for k = 1, #trace do
    local parts = {}
    for _, side in ipairs({ "fill", "load" }) do
      local t = trace[k][side]
      if t then
        parts[#parts + 1] = string.format("%s %7.2f -> %7.2f (%6.2f)", side, t[1] * 1e3, t[2] * 1e3, t[3] * 1e3)
        control[side] = control[side] + (t[2] - t[1] - t[3])
      end
    end
    print(string.format("  chunk %3d: %s", k, table.concat(parts, "   ")))
  end
  print(string.format("  control (asked -> answered, less the copy): fills %.2f ms, loads %.2f ms in all",
    control.fill * 1e3, control.load * 1e3))
end
local publications = tonumber(arg[2] or "") or 5
local RECIPE = arg[3] or "tests/fixtures/recipes/cuda_30b.lua"

local function median(values)
  local sorted = { unpack(values) }
  table.sort(sorted)
  local n = #sorted
  return n % 2 == 1 and sorted[(n + 1) / 2] or (sorted[n / 2] + sorted[n / 2 + 1]) / 2
end

-- One flat device copy of `bytes` (best of 5, ms).
local function flat_copy_ms(bytes)
  local source = assert(cuda.buffer(0, bytes))
  local target = assert(cuda.buffer(0, bytes))
  local stream = assert(cuda.stream(0))
  local start, stop = assert(cuda.event(0, true)), assert(cuda.event(0, true))
  local best = math.huge
  for _ = 1, 6 do
    assert(start:record(stream))
    assert(cuda.memcpy(target, 0, source, 0, bytes, stream))
    assert(stop:record(stream))
    assert(stop:synchronize())
    best = math.min(best, assert(stop:elapsed(start)))
  end
  for _, object in ipairs({ start, stop, stream, target, source }) do
    object:close()
  end
  return best
end

loop.spawn(function()
  local base = recipe_module.load(RECIPE)
  local bytes = require("wsync.recipe.prepare").prepare(base).bytes
  local flat = flat_copy_ms(bytes)
  local packed_floor = 2 * flat
  local plan = require("wsync.recipe.prepare").prepare(base)
  print(string.format("cuda publish: %s, %d publications per size; model %.3f GB, %d canonical tensors", RECIPE,
    publications, bytes / 1e9, #plan.canonical))
  print(string.format("floors: one flat cudaMemcpyAsync %.2f ms (the direct path's); the packed path (pack + "
    .. "unpack) %.2f ms", flat, packed_floor))
  print(string.format("| %-44s | %6s | %9s | %8s | %8s | %9s | %9s | %8s |", "buffers", "chunks", "total ms", "fill ms",
    "load ms", "copies ms", "vs floor", "GB/s"))
  local best, fastest = nil, {}
  for index, gib in ipairs(sizes) do
    local recipe = recipe_module.load(RECIPE)
    local direct = gib == "direct" or gib == "direct-tensor"
    recipe.buffers.direct = direct
    recipe.trainer.storage = gib == "direct-tensor" and "tensor" or "one"
    if not direct then
      recipe.buffers.bytes = math.floor(gib * 1024 * 1024 * 1024)
      recipe.buffers.count = counts[index]
      recipe.buffers.order = ordered[index] and "device" or "host"
    end
    recipe.trainer.steps = publications
    if tiles[index] then
      uv.os_setenv("WSYNC_CUDA_COPY_TILE", tiles[index]) -- (the ranks and the runtime inherit it)
    end
    -- (Every publication traced, for the chunk-by-chunk table after this one.)
    local reports = session.run(recipe, { publication = { trace = true, serial = serial[index] } })
    uv.os_unsetenv("WSYNC_CUDA_COPY_TILE")
    local totals, fills, loads, copies = {}, {}, {}, {}
    local label = (serial[index] and "serial " or "") .. (ordered[index] and "device-ordered " or "")
      .. (direct and gib or string.format("%d x %.1f GiB", counts[index], gib))
      .. (tiles[index] == "0" and ", per-warp ranges"
        or tiles[index] and string.format(", tiles %d KiB", tiles[index] / 1024) or "")
    for at = 2, #reports do
      local t = reports[at].timings
      totals[#totals + 1], fills[#fills + 1], loads[#loads + 1] = t.total, t.fill, t.load
      copies[#copies + 1] = (t.fill_copy or 0) + (t.load_copy or 0)
      if not fastest[index] or t.total < fastest[index].report.timings.total then
        fastest[index] = { label = label, report = reports[at] }
      end
    end
    local total = median(totals) * 1e3
    local floor = direct and flat or packed_floor
    print(string.format("| %-44s | %6d | %9.1f | %8.1f | %8.1f | %9.1f | %9.2f | %8.0f |", label,
      reports[1].chunks, total, median(fills) * 1e3, median(loads) * 1e3,
      median(copies) * 1e3, total / floor, bytes / (total / 1e3) / 1e9))
    local key = direct and "direct" or "packed"
    best = best or {}
    if not best[key] or total < best[key].total then
      best[key] = { total = total, label = label, floor = floor }
    end
  end
  for index in ipairs(sizes) do
    if fastest[index] then
      print_trace(fastest[index].label, fastest[index].report)
    end
  end
  for _, key in ipairs({ "packed", "direct" }) do
    local b = best[key]
    if b then
      print(string.format("publish %s %s (%.2f GB, %d tensors): best %.1f ms%s = %.2fx its floor (%.1f ms) "
        .. "measured in this run; target 1.25x", base.name, key, bytes / 1e9, #plan.canonical, b.total,
        key == "packed" and string.format(" with %s buffers", b.label) or "", b.total / b.floor, b.floor))
    end
  end
  io.stdout:flush()
end)
loop.run()
