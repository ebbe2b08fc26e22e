-- The host side of the cuda backend's batched copies (host/cuda_plan.c),
-- through the FFI and without a GPU: ws_cuda_copy_layout checks ops against
-- their regions and splits them into the descriptors one kernel launch runs.
-- Here the regions are host memory and a few lines of Lua play the kernel
-- (each descriptor: `rows` rows of `width` bytes, pitches apart), so every
-- layout is checked for writing exactly what a row-by-row reference copy
-- writes, for spreading the bytes evenly over the warps, and for keeping
-- pieces aligned where the ops allow it. The tiled layout's walk
-- (ws_cuda_copy_tiles_on_host: the kernel's tiles and parts, on the host) is
-- checked the same way, at several tile sizes and warp counts.
local ffi = require("ffi")
local C = (function()
  local ok, module = pcall(require, "wsync.native.ffi")
  return ok and module or require("wsync.ffi")
end)()

local PIECE_MAX = tonumber(C.WS_CUDA_PIECE_MAX)
local WARP_MIN_BYTES = tonumber(C.WS_CUDA_WARP_MIN_BYTES)

local function detail()
  return ffi.string(C.ws_error_detail())
end

-- Host memory at a 64-byte boundary, kept alive until the spec ends.
local anchors = {}
local function bytes(size, fill)
  local block = ffi.new("uint8_t[?]", size + 64)
  anchors[#anchors + 1] = block
  local data = block + (64 - tonumber(ffi.cast("uintptr_t", block) % 64)) % 64
  ffi.fill(data, size, fill or 0)
  return data
end

local function pattern(size, salt)
  local data = bytes(size)
  for i = 0, size - 1 do
    data[i] = (i * 131 + 17 + (salt or 0)) % 251
  end
  return data
end

local function address(pointer)
  return tonumber(ffi.cast("uintptr_t", pointer))
end

local function region_array(list)
  local regions = ffi.new("ws_cuda_region[?]", #list)
  for i, region in ipairs(list) do
    regions[i - 1].pointer = address(region.data)
    regions[i - 1].size = region.size
    regions[i - 1].device = 0
  end
  return regions
end

-- ops: {target (region from 1), source, to, from, rows, width, target_pitch,
-- source_pitch}
local function op_array(ops)
  local array = ffi.new("ws_cuda_copy_op[?]", math.max(#ops, 1))
  for i, op in ipairs(ops) do
    local entry = array[i - 1]
    entry.target_region, entry.source_region = op.target - 1, op.source - 1
    entry.target_offset, entry.source_offset = op.to, op.from
    entry.rows, entry.width = op.rows or 1, op.width
    entry.target_pitch = op.target_pitch or op.width
    entry.source_pitch = op.source_pitch or op.width
  end
  return array
end

-- Lays the ops out for `warps` warps; returns the descriptors, warp_start
-- and the warps used, or nil, status.
local function layout(regions, ops, warps)
  local region_list, op_list = region_array(regions), op_array(ops)
  local count, used = ffi.new("size_t[1]"), ffi.new("uint32_t[1]")
  local status = C.ws_cuda_copy_layout(region_list, #regions, op_list, #ops, warps, nil, 0, count, nil, used)
  if status ~= 0 then
    return nil, status
  end
  local n = tonumber(count[0])
  local descs = ffi.new("ws_cuda_copy_desc[?]", math.max(n, 1))
  local warp_start = ffi.new("uint32_t[?]", used[0] + 1)
  status = C.ws_cuda_copy_layout(region_list, #regions, op_list, #ops, warps, descs, n, count, warp_start, used)
  assert(status == 0, detail())
  assert(tonumber(count[0]) == n)
  return { descs = descs, count = n, warp_start = warp_start, warps = tonumber(used[0]) }
end

-- The kernel, played on the host: every descriptor of every warp.
local function run(result)
  for warp = 0, result.warps - 1 do
    for i = result.warp_start[warp], result.warp_start[warp + 1] - 1 do
      local desc = result.descs[i]
      local target = ffi.cast("uint8_t *", desc.target)
      local source = ffi.cast("uint8_t *", desc.source)
      for row = 0, desc.rows - 1 do
        ffi.copy(target + row * tonumber(desc.target_pitch), source + row * tonumber(desc.source_pitch), desc.width)
      end
    end
  end
end

local function reference(regions, ops)
  for _, op in ipairs(ops) do
    for row = 0, (op.width > 0 and op.rows or 1) - 1 do
      ffi.copy(regions[op.target].data + op.to + row * (op.target_pitch or op.width),
        regions[op.source].data + op.from + row * (op.source_pitch or op.width), op.width)
    end
  end
end

local function total_bytes(ops)
  local total = 0
  for _, op in ipairs(ops) do
    total = total + (op.rows or 1) * op.width
  end
  return total
end

-- Checks the layout's shape: warp_start covers every descriptor in order,
-- pieces stay under the limit, the bytes add up, and no warp holds more than
-- its share plus one row.
local function check_shape(result, ops, warps)
  assert.is_true(result.warps >= 1 and result.warps <= warps)
  assert.are.equal(0, result.warp_start[0])
  assert.are.equal(result.count, result.warp_start[result.warps])
  local widest_row, total = 0, total_bytes(ops)
  for _, op in ipairs(ops) do
    local strided = (op.target_pitch or op.width) ~= op.width or (op.source_pitch or op.width) ~= op.width
    if (op.rows or 1) > 1 and strided then
      widest_row = math.max(widest_row, op.width)
    end
  end
  local share = math.ceil(total / result.warps / 16) * 16
  local sum = 0
  for warp = 0, result.warps - 1 do
    assert.is_true(result.warp_start[warp] <= result.warp_start[warp + 1])
    local warp_bytes = 0
    for i = result.warp_start[warp], result.warp_start[warp + 1] - 1 do
      local piece = tonumber(result.descs[i].rows) * tonumber(result.descs[i].width)
      assert.is_true(piece > 0 and piece <= PIECE_MAX)
      warp_bytes = warp_bytes + piece
    end
    assert.is_true(warp_bytes <= share + widest_row + 16,
      string.format("warp %d holds %d bytes, its share is %d", warp, warp_bytes, share))
    sum = sum + warp_bytes
  end
  assert.are.equal(total, sum)
end

local function same(a, b, size)
  return ffi.string(a, size) == ffi.string(b, size)
end

-- Host memory for `regions_spec` ({size, source?} each): the regions a
-- layout copies (`got`: sources patterned, targets 0xaa) and those the
-- reference copies into (`want`: the same sources, fresh targets).
local function host_regions(regions_spec)
  local got, want = {}, {}
  for i, spec in ipairs(regions_spec) do
    got[i] = { data = spec.source and pattern(spec.size, i * 7) or bytes(spec.size, 0xaa), size = spec.size }
    want[i] = { data = spec.source and got[i].data or bytes(spec.size, 0xaa), size = spec.size }
  end
  return got, want
end

-- Runs the reference copy of `ops` into `want` and asserts that every target
-- of `got` holds the same (`what`: the layout, for the message).
local function assert_like_reference(regions_spec, got, want, ops, what)
  reference(want, ops)
  for i, spec in ipairs(regions_spec) do
    if not spec.source then
      assert.is_true(same(got[i].data, want[i].data, spec.size),
        string.format("region %d differs from the reference (%s)", i, what))
    end
  end
end

-- Random ops between the regions {1 target, 2 source, 3 target, 4 source}
-- of `regions` (sizes; the targets' ops back to back, gaps of up to 17
-- bytes): `count` tries, each with rows 1 or, at `strided` odds, rows in
-- `rows`, a width from `width()`, and pitches up to `source_pad` / 64 bytes
-- past it.
local function random_ops(regions, count, strided, rows_range, width, source_pad)
  local ops, cursor = {}, { [1] = 0, [3] = 0 }
  for _ = 1, count do
    local target = math.random() < 0.5 and 1 or 3
    local source = math.random() < 0.5 and 2 or 4
    local rows = math.random() < strided and math.random(rows_range[1], rows_range[2]) or 1
    local op_width = width()
    local target_pitch = op_width + (rows > 1 and math.random(0, 64) or 0)
    local source_pitch = op_width + (rows > 1 and math.random(0, source_pad) or 0)
    local span = (rows - 1) * target_pitch + op_width
    if cursor[target] + span <= regions[target].size then
      local from = math.random(0, regions[source].size - ((rows - 1) * source_pitch + op_width))
      ops[#ops + 1] = { target = target, source = source, to = cursor[target], from = from, rows = rows,
        width = op_width, target_pitch = target_pitch, source_pitch = source_pitch }
      cursor[target] = cursor[target] + span + math.random(0, 17)
    end
  end
  return ops
end

-- 10,000 tiny contiguous ops from region 2 into region 1.
local function tiny_ops()
  local ops, to = {}, 0
  for i = 1, 10000 do
    local width = (i * 37) % 61 + 1
    ops[i] = { target = 1, source = 2, to = to, from = (i * 101) % 100000, width = width }
    to = to + width + (i % 3)
  end
  return ops
end

-- Lays out, runs and compares with the reference.
local function check_copies(regions_spec, ops, warps)
  local got, want = host_regions(regions_spec)
  local result = assert(layout(got, ops, warps), detail())
  check_shape(result, ops, warps)
  run(result)
  assert_like_reference(regions_spec, got, want, ops, string.format("%d warps", warps))
  return result
end

local MiB = 1024 * 1024

describe("ws_cuda_copy_layout", function()
  local two = { { size = 4 * MiB }, { size = 4 * MiB, source = true } }

  it("copies aligned contiguous ops exactly, spread over the warps", function()
    local ops = {
      { target = 1, source = 2, to = 0, from = 0, width = MiB },
      { target = 1, source = 2, to = 2 * MiB, from = MiB, width = 64 * 1024 },
    }
    local result = check_copies(two, ops, 64)
    assert.are.equal(64, result.warps)
  end)

  it("copies one huge op as one piece per warp, each starting 16-byte aligned", function()
    local ops = { { target = 1, source = 2, to = 16, from = 32, width = 3 * MiB + 48 } }
    local result = check_copies(two, ops, 100)
    assert.are.equal(100, result.count)
    for i = 0, result.count - 1 do
      assert.are.equal(0, tonumber(result.descs[i].target % 16), "descriptor " .. i)
      assert.are.equal(0, tonumber(result.descs[i].source % 16), "descriptor " .. i)
    end
  end)

  it("copies unaligned ops and ops whose ends are misaligned differently", function()
    local ops = {
      { target = 1, source = 2, to = 3, from = 3, width = 100000 },
      { target = 1, source = 2, to = 200001, from = 5, width = 77777 },
      { target = 1, source = 2, to = 400000, from = 1, width = 1 },
      { target = 1, source = 2, to = 400002, from = 2, width = 2 },
    }
    check_copies(two, ops, 37)
  end)

  it("copies strided ops, cutting between rows and within rows wider than a share", function()
    local ops = {
      { target = 1, source = 2, to = 0, from = 8, rows = 1000, width = 384, target_pitch = 384, source_pitch = 1536 },
      { target = 1, source = 2, to = MiB, from = 0, rows = 300, width = 1000, target_pitch = 1003,
        source_pitch = 2001 },
      { target = 1, source = 2, to = 2 * MiB, from = 0, rows = 3, width = 300000, target_pitch = 300016,
        source_pitch = 400000 },
    }
    check_copies(two, ops, 50)
  end)

  it("copies 10,000 tiny ops with every warp busy", function()
    local result = check_copies(two, tiny_ops(), 512)
    assert.are.equal(512, result.warps)
  end)

  it("copies random mixes between several regions in one layout", function()
    math.randomseed(20240611)
    local regions = { { size = MiB }, { size = MiB, source = true }, { size = 2 * MiB }, { size = MiB, source = true } }
    for _ = 1, 6 do
      local ops = random_ops(regions, 200, 0.3, { 1, 40 }, function()
        return math.random(1, 2000)
      end, 64)
      check_copies(regions, ops, math.random(1, 300))
    end
  end)

  it("gives small plans only the warps that have at least a few hundred bytes", function()
    local result = check_copies(two, { { target = 1, source = 2, to = 0, from = 0, width = 1000 } }, 1000)
    assert.are.equal(math.ceil(1000 / WARP_MIN_BYTES), result.warps)
  end)

  it("skips empty ops, however many rows they claim", function()
    local result = check_copies(two, {
      { target = 1, source = 2, to = 0, from = 0, rows = 2 ^ 40, width = 0 },
      { target = 1, source = 2, to = 0, from = 0, rows = 0, width = 64 },
      { target = 1, source = 2, to = 64, from = 0, width = 64 },
    }, 8)
    assert.are.equal(1, result.count)
  end)

  it("lays out nothing for no ops", function()
    local result = assert(layout(two, {}, 8))
    assert.are.equal(0, result.count)
    assert.are.equal(1, result.warps)
  end)
end)

-- The tiled layout of `ops`: its descriptors in stream order and their
-- starts, or nil, status.
local function tile_layout(regions, ops)
  local region_list, op_list = region_array(regions), op_array(ops)
  local count = ffi.new("size_t[1]")
  local status = C.ws_cuda_copy_tile_layout(region_list, #regions, op_list, #ops, nil, 0, count, nil)
  if status ~= 0 then
    return nil, status
  end
  local n = tonumber(count[0])
  local descs = ffi.new("ws_cuda_copy_desc[?]", math.max(n, 1))
  local starts = ffi.new("uint64_t[?]", n + 1)
  assert(C.ws_cuda_copy_tile_layout(region_list, #regions, op_list, #ops, descs, n, count, starts) == 0, detail())
  return { descs = descs, starts = starts, count = n }
end

-- Lays the ops out in tiles, walks them on the host as `warps` warps of
-- `tile` bytes would, and compares with the reference.
local function check_tiles(regions_spec, ops, tile, warps)
  local got, want = host_regions(regions_spec)
  local result = assert(tile_layout(got, ops), detail())
  assert.are.equal(0, tonumber(result.starts[0]))
  assert.are.equal(total_bytes(ops), tonumber(result.starts[result.count]))
  for i = 0, result.count - 1 do
    local desc = result.descs[i]
    assert.are.equal(tonumber(result.starts[i]) + tonumber(desc.rows) * tonumber(desc.width),
      tonumber(result.starts[i + 1]))
  end
  assert.are.equal(0, C.ws_cuda_copy_tiles_on_host(result.descs, result.starts, result.count, tile, warps), detail())
  assert_like_reference(regions_spec, got, want, ops, string.format("tiles of %d, %d warps", tile, warps))
  return result
end

describe("ws_cuda_copy_tile_layout and its walk", function()
  local two = { { size = 4 * MiB }, { size = 4 * MiB, source = true } }

  it("keeps every op whole (below the piece limit), in stream order", function()
    local ops = {
      { target = 1, source = 2, to = 0, from = 0, width = MiB },
      { target = 1, source = 2, to = 2 * MiB, from = 8, rows = 100, width = 384, target_pitch = 384,
        source_pitch = 1536 },
    }
    local result = check_tiles(two, ops, 512, 3)
    assert.are.equal(2, result.count)
    assert.are.equal(MiB, tonumber(result.starts[1]))
  end)

  it("copies contiguous, misaligned and strided ops exactly at every tile size and warp count", function()
    math.randomseed(20261201)
    local regions = { { size = MiB }, { size = MiB, source = true }, { size = 2 * MiB }, { size = MiB, source = true } }
    for round = 1, 8 do
      local ops = random_ops(regions, 150, 0.4, { 2, 60 }, function()
        return math.random() < 0.3 and math.random(1, 40) or math.random(1, 5000)
      end, 300)
      local tile = ({ 512, 1024, 4096, 65536 })[round % 4 + 1]
      check_tiles(regions, ops, tile, ({ 1, 7, 64, 1000 })[math.floor(round / 2) % 4 + 1])
    end
  end)

  it("copies 10,000 tiny ops, many in one tile", function()
    check_tiles(two, tiny_ops(), 4096, 33)
  end)

  it("copies rows wider than a tile, cut within rows", function()
    local ops = { { target = 1, source = 2, to = 5, from = 3, rows = 3, width = 300000, target_pitch = 300016,
      source_pitch = 400000 } }
    check_tiles(two, ops, 8192, 5)
  end)

  it("refuses a tile that is no multiple of 512 bytes or too large, and a walk without warps", function()
    local result = assert(tile_layout((host_regions(two)), { { target = 1, source = 2, to = 0, from = 0,
      width = 64 } }))
    for _, tile in ipairs({ 0, 256, 1000, C.WS_CUDA_TILE_MAX + 512 }) do
      assert.are.equal(C.WS_EINVAL, C.ws_cuda_copy_tiles_on_host(result.descs, result.starts, 1, tile, 4))
      assert.matches("a tile of " .. tostring(tile) .. " bytes", detail(), 1, true)
    end
    assert.are.equal(C.WS_EINVAL, C.ws_cuda_copy_tiles_on_host(result.descs, result.starts, 1, 512, 0))
  end)
end)

describe("ws_cuda_copy_layout refuses", function()
  local regions = { { data = bytes(4096), size = 4096 }, { data = bytes(1024), size = 1024 } }

  local function refused(ops, pattern_text)
    local result, status = layout(regions, ops, 8)
    assert.is_nil(result)
    assert.are.equal(C.WS_EINVAL, status)
    assert.matches(pattern_text, detail(), 1, true)
  end

  it("a target range past its region, naming the op", function()
    refused({ { target = 1, source = 2, to = 0, from = 0, width = 8 },
      { target = 1, source = 2, to = 4090, from = 0, width = 7 } },
      "cuda copy op 1: target [4090, +1 rows x 7, pitch 7) exceeds region 0 (4096 bytes)")
  end)

  it("a source range past its region", function()
    refused({ { target = 1, source = 2, to = 0, from = 1000, width = 25 } },
      "cuda copy op 0: source [1000, +1 rows x 25, pitch 25) exceeds region 1 (1024 bytes)")
  end)

  it("a strided op whose last row ends past its region", function()
    refused({ { target = 1, source = 2, to = 0, from = 0, rows = 9, width = 100, target_pitch = 100,
      source_pitch = 128 } }, "cuda copy op 0: source [0, +9 rows x 100, pitch 128) exceeds region 1")
  end)

  it("rows that overlap (a pitch below the width)", function()
    refused({ { target = 1, source = 2, to = 0, from = 0, rows = 2, width = 100, target_pitch = 50,
      source_pitch = 100 } }, "cuda copy op 0: target")
  end)

  it("a region index past the list", function()
    refused({ { target = 3, source = 2, to = 0, from = 0, width = 1 } }, "cuda copy op 0: target region 2 of 2")
  end)

  it("sizes that overflow", function()
    refused({ { target = 1, source = 2, to = 0, from = 0, rows = 2 ^ 62, width = 4, target_pitch = 2 ^ 62,
      source_pitch = 4 } }, "cuda copy op 0: target")
  end)

  it("more ops than a plan holds", function()
    local count, used = ffi.new("size_t[1]"), ffi.new("uint32_t[1]")
    local ops = ffi.new("ws_cuda_copy_op[1]")
    assert.are.equal(C.WS_EINVAL, C.ws_cuda_copy_layout(region_array(regions), 2, ops, C.WS_CUDA_OPS_MAX + 1, 8, nil,
      0, count, nil, used))
    assert.matches("copy ops in one plan", detail(), 1, true)
  end)

  it("too small a descriptor array", function()
    local region_list = region_array(regions)
    local ops = op_array({ { target = 1, source = 2, to = 0, from = 0, width = 1024 } })
    local count, used = ffi.new("size_t[1]"), ffi.new("uint32_t[1]")
    assert.are.equal(0, C.ws_cuda_copy_layout(region_list, 2, ops, 1, 4, nil, 0, count, nil, used), detail())
    assert.are.equal(4, tonumber(count[0]))
    local descs, warp_start = ffi.new("ws_cuda_copy_desc[3]"), ffi.new("uint32_t[5]")
    assert.are.equal(C.WS_EINVAL, C.ws_cuda_copy_layout(region_list, 2, ops, 1, 4, descs, 3, count, warp_start, used))
    assert.matches("room for 3 descriptors, 4 needed", detail(), 1, true)
  end)
end)

describe("ws_cuda_copy_plan_create and ws_cuda_synth_plan_create", function()
  local regions = region_array({ { data = bytes(4096), size = 4096 } })

  it("refuse a bad op before they look for a device", function()
    local ops = op_array({ { target = 1, source = 1, to = 4000, from = 0, width = 100 } })
    local out = ffi.new("ws_cuda_copy_plan *[1]")
    assert.are.equal(C.WS_EINVAL, C.ws_cuda_copy_plan_create(0, regions, 1, ops, 1, out))
    assert.matches("cuda copy op 0: target [4000, +1 rows x 100, pitch 100) exceeds region 0", detail(), 1, true)
  end)

  it("refuse a tiled plan's bad tile before they look for a device", function()
    local ops = op_array({ { target = 1, source = 1, to = 0, from = 0, width = 100 } })
    local out = ffi.new("ws_cuda_copy_plan *[1]")
    assert.are.equal(C.WS_EINVAL, C.ws_cuda_copy_plan_create_tiled(0, regions, 1, ops, 1, 700, out))
    assert.matches("a tile of 700 bytes (a multiple of 512", detail(), 1, true)
  end)

  it("refuse a synthetic op of a dtype the generator does not make", function()
    local ops = ffi.new("ws_cuda_synth_op[1]")
    ops[0].dtype, ops[0].rows, ops[0].row_elements = C.WS_DTYPE_INT8, 1, 4
    local out = ffi.new("ws_cuda_synth_plan *[1]")
    assert.are.equal(C.WS_EINVAL, C.ws_cuda_synth_plan_create(0, regions, 1, ops, 1, out))
    assert.matches("cuda synthetic op 0: dtype int8 is not generated", detail(), 1, true)
  end)

  it("refuse a synthetic op past its region or off its element alignment", function()
    local ops = ffi.new("ws_cuda_synth_op[1]")
    ops[0].dtype, ops[0].rows, ops[0].row_elements, ops[0].offset = C.WS_DTYPE_BFLOAT16, 1, 2048, 2
    local out = ffi.new("ws_cuda_synth_plan *[1]")
    assert.are.equal(C.WS_EINVAL, C.ws_cuda_synth_plan_create(0, regions, 1, ops, 1, out))
    assert.matches("cuda synthetic op 0: [2, +1 rows x 4096, pitch 0) exceeds region 0", detail(), 1, true)
    ops[0].row_elements, ops[0].offset, ops[0].dtype = 4, 2, C.WS_DTYPE_FLOAT32
    assert.are.equal(C.WS_EINVAL, C.ws_cuda_synth_plan_create(0, regions, 1, ops, 1, out))
    assert.matches("is not a multiple of the 4-byte element", detail(), 1, true)
  end)

  it("refuse tensor element indices a check cannot report", function()
    local ops = ffi.new("ws_cuda_synth_op[1]")
    ops[0].dtype, ops[0].rows, ops[0].row_elements, ops[0].first = C.WS_DTYPE_BFLOAT16, 1, 4, 2 ^ 40
    local out = ffi.new("ws_cuda_synth_plan *[1]")
    assert.are.equal(C.WS_EINVAL, C.ws_cuda_synth_plan_create(0, regions, 1, ops, 1, out))
    assert.matches("tensor elements past 2^40", detail(), 1, true)
  end)
end)

-- ws_cuda_copy_split_bulk of `ops` over `regions` with `min_bytes`: the bulk
-- copies ({source, target, bytes} as offsets from region data, with the
-- region) and the rest as op tables, or nil, status.
local function split(regions, ops, min_bytes)
  local region_list, op_list = region_array(regions), op_array(ops)
  local rest = ffi.new("ws_cuda_copy_op[?]", math.max(#ops, 1))
  local bulk = ffi.new("ws_cuda_bulk_copy[?]", math.max(#ops, 1))
  local rest_count, bulk_count = ffi.new("size_t[1]"), ffi.new("size_t[1]")
  local status = C.ws_cuda_copy_split_bulk(region_list, #regions, op_list, #ops, min_bytes, rest, rest_count, bulk,
    bulk_count)
  if status ~= 0 then
    return nil, status
  end
  local out = { bulk = {}, rest = {} }
  for i = 0, tonumber(bulk_count[0]) - 1 do
    out.bulk[#out.bulk + 1] = { source = tonumber(bulk[i].source), target = tonumber(bulk[i].target),
      bytes = tonumber(bulk[i].bytes) }
  end
  for i = 0, tonumber(rest_count[0]) - 1 do
    local op = rest[i]
    out.rest[#out.rest + 1] = { target = op.target_region + 1, source = op.source_region + 1,
      to = tonumber(op.target_offset), from = tonumber(op.source_offset), rows = tonumber(op.rows),
      width = tonumber(op.width), target_pitch = tonumber(op.target_pitch), source_pitch = tonumber(op.source_pitch) }
  end
  return out
end

describe("ws_cuda_copy_split_bulk", function()
  local four = { { size = 4 * MiB }, { size = 4 * MiB, source = true }, { size = 4 * MiB },
    { size = 4 * MiB, source = true } }

  -- Runs the bulk copies (as CUDA's copy would) and the rest (as the
  -- kernel's reference) and compares with the reference copy of the ops.
  local function check_equivalent(ops, min_bytes)
    local got, want = host_regions(four)
    local result = assert(split(got, ops, min_bytes), detail())
    for _, copy in ipairs(result.bulk) do
      ffi.copy(ffi.cast("uint8_t *", copy.target), ffi.cast("uint8_t *", copy.source), copy.bytes)
    end
    reference(got, result.rest)
    assert_like_reference(four, got, want, ops, "bulk and rest")
    return result
  end

  it("joins ops that continue one another on both sides into one bulk copy", function()
    local got = host_regions(four)
    -- (Per-expert gate and up rows back to back, as a packed expert tensor and
    -- vLLM's fused weight hold them at TP 1; a strided op with pitch = width
    -- counts as contiguous.)
    local ops = { { target = 1, source = 2, to = 4096, from = 64, width = 1024 },
      { target = 1, source = 2, to = 5120, from = 1088, rows = 4, width = 256 },
      { target = 1, source = 2, to = 6144, from = 2112, width = 3000 } }
    local result = assert(split(got, ops, 4096))
    assert.are.same({}, result.rest)
    assert.are.same({ { source = address(got[2].data) + 64, target = address(got[1].data) + 4096, bytes = 5048 } },
      result.bulk)
    check_equivalent(ops, 4096)
    -- (In any order: a layer's tensors come down, gate, up per expert.)
    local reversed = { ops[3], ops[1], ops[2] }
    assert.are.same(result.bulk, assert(split(got, reversed, 4096)).bulk)
  end)

  it("keeps a joined run shorter than the minimum for the kernel, as one op", function()
    local ops = { { target = 1, source = 2, to = 0, from = 0, width = 100 },
      { target = 1, source = 2, to = 100, from = 100, width = 28 } }
    local result = check_equivalent(ops, 4096)
    assert.are.same({}, result.bulk)
    assert.are.same({ { target = 1, source = 2, to = 0, from = 0, rows = 1, width = 128, target_pitch = 128,
      source_pitch = 128 } }, result.rest)
  end)

  it("breaks runs at a gap on either side, another region and a strided op", function()
    local ops = {
      { target = 1, source = 2, to = 0, from = 0, width = 8192 },
      { target = 1, source = 2, to = 8192, from = 8200, width = 8192 }, -- (a source gap)
      { target = 1, source = 2, to = 16400, from = 16392, width = 8192 }, -- (a target gap)
      { target = 3, source = 2, to = 0, from = 24584, width = 8192 }, -- (another target region)
      { target = 3, source = 2, to = 8192, from = 32776, rows = 2, width = 4096, target_pitch = 4100,
        source_pitch = 4096 }, -- (strided: the kernel's)
    }
    local result = check_equivalent(ops, 8192)
    assert.are.equal(4, #result.bulk)
    assert.are.equal(1, #result.rest)
    assert.are.equal(4100, result.rest[1].target_pitch)
  end)

  it("leaves the ops as they are with a minimum of 0", function()
    local ops = { { target = 1, source = 2, to = 0, from = 0, width = MiB },
      { target = 1, source = 2, to = MiB, from = MiB, width = MiB } }
    local result = check_equivalent(ops, 0)
    assert.are.same({}, result.bulk)
    assert.are.equal(2, #result.rest)
    assert.are.equal(MiB, result.rest[2].width)
  end)

  it("copies exactly what the ops copy, for random ops with runs among them", function()
    math.randomseed(20)
    local joined, bulked = 0, 0
    for _ = 1, 20 do
      local ops = random_ops(four, 60, 0.3, { 2, 9 }, function()
        return math.random(1, 70000)
      end, 64)
      -- (Some continuing ops: each one's next neighbour made to start where it ends.)
      for i = 2, #ops do
        local previous, op = ops[i - 1], ops[i]
        if math.random() < 0.5 and (previous.rows or 1) == 1 and (op.rows or 1) == 1 and previous.target == op.target
            and previous.source == op.source and op.to >= previous.to + previous.width
            and previous.from + previous.width + op.width <= 4 * MiB then
          op.to, op.from = previous.to + previous.width, previous.from + previous.width
        end
      end
      local result = check_equivalent(ops, math.random(0, 3) * 65536)
      joined = joined + #ops - #result.rest - #result.bulk
      bulked = bulked + #result.bulk
    end
    assert.is_true(joined >= 20 and bulked >= 10, string.format("%d ops joined, %d bulk copies", joined, bulked))
  end)

  it("refuses ops outside their regions, as the layout does", function()
    local got = host_regions(four)
    local result, status = split(got, { { target = 1, source = 2, to = 4 * MiB - 10, from = 0, width = 20 } }, 1)
    assert.is_nil(result)
    assert.are.equal(tonumber(C.WS_EINVAL), status)
    assert.matches("cuda copy op 0: target", detail(), 1, true)
  end)
end)

describe("ws_cuda_fp8_layout", function()
  local fp8 = require("wsync.native.fp8")
  local LIMIT = tonumber(C.WS_CUDA_FP8_PIECE_ELEMENTS)

  -- Region 1: float8 target and scales; region 2: bfloat16 source of
  -- varied values (the pattern's bytes, their exponents kept in range).
  local TARGET, SOURCE = 600000, 1200000
  local target, source = bytes(TARGET, 0xaa), pattern(SOURCE)
  for i = 1, SOURCE - 1, 2 do
    source[i] = 0x30 + source[i] % 32 + (source[i] % 2) * 0x80 -- (sign, exponent 2^-31 .. 2^32)
  end
  local regions = region_array({ { data = target, size = TARGET }, { data = source, size = SOURCE } })

  local function arrays(groups, ops)
    local group_array = ffi.new("ws_fp8_group[?]", math.max(#groups, 1))
    for i, scale_offset in ipairs(groups) do
      group_array[i - 1].target, group_array[i - 1].scale_offset = 0, scale_offset
    end
    local op_records = ffi.new("ws_fp8_op[?]", math.max(#ops, 1))
    for i, op in ipairs(ops) do
      local record = op_records[i - 1]
      record.group, record.target, record.source = op.group, 0, 1
      record.target_offset, record.source_offset = op.to, op.from
      record.rows, record.columns = op.rows or 1, op.columns
      record.target_pitch = op.target_pitch or op.columns
      record.source_pitch = op.source_pitch or 2 * op.columns
    end
    return group_array, op_records
  end

  local function fp8_layout(groups, ops)
    local group_array, op_records = arrays(groups, ops)
    local count = ffi.new("size_t[1]")
    local status = C.ws_cuda_fp8_layout(regions, 2, group_array, #groups, op_records, #ops, nil, 0, count)
    if status ~= 0 then
      return nil, detail()
    end
    local pieces = ffi.new("ws_cuda_fp8_piece[?]", math.max(tonumber(count[0]), 1))
    assert.are.equal(0, C.ws_cuda_fp8_layout(regions, 2, group_array, #groups, op_records, #ops, pieces, count[0],
      count))
    return pieces, tonumber(count[0])
  end

  -- Plays the kernels on the pieces (every group's amax, then every element
  -- under its group's scale) into a copy of the target, and compares it with
  -- the host reference's run of the same ops.
  local function same_as_reference(groups, ops)
    local pieces, count = fp8_layout(groups, ops)
    local played = bytes(TARGET, 0xaa)
    local amax = {}
    local function each(piece, visit)
      for row = 0, piece.rows - 1 do
        local from = ffi.cast("uint16_t *", piece.source + row * piece.source_pitch)
        local to = ffi.cast("uint8_t *", piece.target + row * piece.target_pitch - address(target)) + address(played)
        for column = 0, piece.columns - 1 do
          local bits = ffi.new("uint32_t[1]", bit.lshift(from[column], 16))
          visit(ffi.cast("float *", bits)[0], to + column)
        end
      end
    end
    for p = 0, count - 1 do
      local piece = pieces[p]
      assert.is_true(piece.rows * piece.columns <= LIMIT)
      assert.is_true(piece.rows == 1 or piece.columns < LIMIT)
      each(piece, function(value)
        amax[piece.group] = math.max(amax[piece.group] or 0, math.abs(value))
      end)
    end
    for p = 0, count - 1 do
      local piece = pieces[p]
      local scale = fp8.scale(amax[piece.group])
      each(piece, function(value, at)
        at[0] = fp8.quantize(value, scale)
      end)
    end
    for g, scale_offset in ipairs(groups) do
      ffi.cast("float *", played + scale_offset)[0] = fp8.scale(amax[g - 1])
    end
    local group_array, op_records = arrays(groups, ops)
    local sizes = ffi.new("size_t[2]", TARGET, SOURCE)
    local ends = ffi.new("void *[2]", target, source)
    -- (the regions as both the targets and the sources, as the device plan has them)
    assert.are.equal(0, C.ws_fp8_run(ends, sizes, 2, ffi.cast("const void *const *", ends), sizes, 2, group_array,
      #groups, op_records, #ops), detail())
    assert.are.equal(ffi.string(target, TARGET), ffi.string(played, TARGET))
    return count
  end

  it("cuts long rows within a row and short ones across rows, and covers every element once", function()
    local count = same_as_reference({ 599000, 599004 }, {
      { group = 0, to = 0, from = 0, rows = 2, columns = LIMIT * 2 + 100, source_pitch = 2 * (LIMIT * 2 + 100) + 6 },
      { group = 1, to = 300000, from = 2 * 300001, rows = 3000, columns = 50, target_pitch = 60, source_pitch = 104 },
      { group = 0, to = 500000, from = 8, rows = 1, columns = 0 }, -- (empty: no piece)
    })
    -- (2 rows of 3 pieces each; 3000 rows of 50 in pieces of 1310 rows)
    assert.are.equal(2 * 3 + 3, count)
  end)

  it("refuses what the host reference refuses, a misaligned scale and a misaligned bfloat16 source", function()
    assert.matches("^fp8 op 0:.*exceed them", select(2, fp8_layout({ 0 }, { { group = 0, to = 0, from = SOURCE - 2,
      columns = 2 } })))
    assert.matches("^fp8 group 1 has no op", select(2, fp8_layout({ 0, 4 }, { { group = 0, to = 8, from = 0,
      columns = 2 } })))
    assert.matches("^cuda fp8 group 0: its float32 scale at byte 2 of region 0 is not 4%-byte aligned",
      select(2, fp8_layout({ 2 }, { { group = 0, to = 8, from = 0, columns = 2 } })))
    assert.matches("^cuda fp8 op 0: its bfloat16 source %(byte 3 of region 1, pitch 4%)",
      select(2, fp8_layout({ 0 }, { { group = 0, to = 8, from = 3, columns = 2 } })))
  end)

  it("makes no plan without CUDA or a device, after checking the ops", function()
    local group_array, op_records = arrays({ 0 }, { { group = 0, to = 8, from = 0, columns = 2 } })
    local out = ffi.new("ws_cuda_fp8_plan *[1]")
    local status = C.ws_cuda_fp8_plan_create(0, regions, 2, group_array, 1, op_records, 1, out)
    assert.are_not.equal(0, status)
    assert.are_not.equal(C.WS_EINVAL, status)
  end)
end)
