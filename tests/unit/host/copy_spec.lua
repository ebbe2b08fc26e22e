-- Batched strided copies (host/copy.c), through the FFI: every path (plain
-- memcpy for small ops, streaming stores for large ones, four interleaved
-- rows for large strided ones, one pass into several targets) must write
-- exactly the bytes a row-by-row reference copy writes, and nothing else.
local ffi = require("ffi")
local C = require("wsync.native.ffi")

local function detail()
  return ffi.string(C.ws_error_detail())
end

-- Plain C memory starting at a 64-byte boundary (the streaming paths depend
-- on the target's alignment), kept alive by `anchors` until the spec ends.
local anchors = {}
local function bytes(size, fill)
  local block = ffi.new("uint8_t[?]", size + 64)
  anchors[#anchors + 1] = block
  local data = block + (64 - tonumber(ffi.cast("uintptr_t", block) % 64)) % 64
  ffi.fill(data, size, fill or 0)
  return data
end

local function pattern(size)
  local data = bytes(size)
  for i = 0, size - 1 do
    data[i] = (i * 131 + 17) % 251
  end
  return data
end

local function op_list(ops)
  local array = ffi.new("ws_copy_op[?]", #ops)
  for i, op in ipairs(ops) do
    local entry = array[i - 1]
    entry.target_offset, entry.source_offset = op.to, op.from
    entry.rows, entry.width = op.rows or 1, op.width
    entry.target_pitch = op.target_pitch or op.width
    entry.source_pitch = op.source_pitch or op.width
  end
  return array
end

-- What the ops must produce, one row at a time with ffi.copy.
local function reference(target, source, ops)
  for _, op in ipairs(ops) do
    for row = 0, (op.rows or 1) - 1 do
      ffi.copy(target + op.to + row * (op.target_pitch or op.width),
        source + op.from + row * (op.source_pitch or op.width), op.width)
    end
  end
end

local function same(a, b, size)
  return ffi.string(a, size) == ffi.string(b, size)
end

local SIZE = 4 * 1024 * 1024

describe("ws_copy_run", function()
  local source = pattern(SIZE)

  local cases = {
    ["small contiguous ops (memcpy)"] = {
      { to = 3, from = 100, width = 1000 }, { to = 5000, from = 0, width = 1 },
    },
    ["a large contiguous op at odd offsets (streaming, head and tail)"] = {
      { to = 7, from = 13, width = 3 * 1024 * 1024 + 77 },
    },
    ["a large strided op with whole lines and aligned rows (four interleaved rows)"] = {
      { to = 64, from = 8, rows = 1027, width = 512, target_pitch = 512, source_pitch = 1024 },
    },
    ["a large strided op with partial lines (row by row)"] = {
      { to = 1, from = 3, rows = 700, width = 1000, target_pitch = 1003, source_pitch = 2001 },
    },
    ["a large strided op with rows that are not aligned (row by row)"] = {
      { to = 16, from = 0, rows = 600, width = 640, target_pitch = 656, source_pitch = 1280 },
    },
  }

  for name, ops in pairs(cases) do
    it("copies " .. name .. " exactly", function()
      local got, want = bytes(SIZE, 0xaa), bytes(SIZE, 0xaa)
      assert.are.equal(0, C.ws_copy_run(got, SIZE, source, SIZE, op_list(ops), #ops), detail())
      reference(want, source, ops)
      assert.is_true(same(got, want, SIZE))
    end)
  end

  it("copies nothing when one op is out of range, and names it", function()
    local target = bytes(SIZE, 0x55)
    local ops = { { to = 0, from = 0, width = 4096 }, { to = SIZE - 10, from = 0, width = 11 } }
    assert.are.equal(C.WS_EINVAL, C.ws_copy_run(target, SIZE, source, SIZE, op_list(ops), #ops))
    assert.matches("copy op 1: target", detail(), 1, true)
    assert.is_true(same(target, bytes(SIZE, 0x55), SIZE))
  end)

  it("skips empty ops at once, however many rows they claim", function()
    local target = bytes(4096, 0x33)
    local ops = ffi.new("ws_copy_op[2]")
    ops[0].rows, ops[0].width, ops[0].target_pitch, ops[0].source_pitch = 2 ^ 62, 0, 1, 1
    ops[1].rows, ops[1].width, ops[1].target_pitch, ops[1].source_pitch = 0, 64, 64, 64
    assert.are.equal(0, C.ws_copy_run(target, 4096, source, SIZE, ops, 2), detail())
    assert.is_true(same(target, bytes(4096, 0x33), 4096))
  end)

  it("counts the bytes the ops move", function()
    local ops = { { to = 0, from = 0, width = 10 }, { to = 0, from = 0, rows = 3, width = 7 } }
    assert.are.equal(31, tonumber(C.ws_copy_bytes(op_list(ops), #ops)))
  end)
end)

describe("ws_copy_run_targets", function()
  local source = pattern(SIZE)
  local ops = {
    { to = 5, from = 0, width = 2 * 1024 * 1024 + 3 },
    { to = 3 * 1024 * 1024, from = 17, width = 1000 },
    { to = 3 * 1024 * 1024 + 4096, from = 0, rows = 100, width = 512, target_pitch = 512, source_pitch = 1024 },
  }

  it("writes into every target what ws_copy_run writes into one", function()
    local first, second, want = bytes(SIZE, 1), bytes(SIZE + 64, 2), bytes(SIZE, 1)
    local targets = ffi.new("void *[2]", first, second)
    local sizes = ffi.new("size_t[2]", SIZE, SIZE + 64)
    assert.are.equal(0, C.ws_copy_run_targets(targets, sizes, 2, source, SIZE, op_list(ops), #ops), detail())
    reference(want, source, ops)
    assert.is_true(same(first, want, SIZE))
    ffi.fill(want, SIZE, 2)
    reference(want, source, ops)
    assert.is_true(same(second, want, SIZE))
  end)

  it("copies into no target when an op does not fit one of them, and names the target", function()
    local first, second = bytes(SIZE, 1), bytes(SIZE / 2, 2)
    local targets = ffi.new("void *[2]", first, second)
    local sizes = ffi.new("size_t[2]", SIZE, SIZE / 2)
    assert.are.equal(C.WS_EINVAL, C.ws_copy_run_targets(targets, sizes, 2, source, SIZE, op_list(ops), #ops))
    assert.matches("copy op 0: target 1 ", detail(), 1, true)
    assert.is_true(same(first, bytes(SIZE, 1), SIZE))
  end)

  it("refuses zero targets", function()
    assert.are.equal(C.WS_EINVAL, C.ws_copy_run_targets(nil, nil, 0, source, SIZE, op_list(ops), #ops))
  end)
end)

describe("ws_copy_prefault", function()
  it("faults in memory and keeps its bytes", function()
    local data = pattern(3 * 4096 + 5)
    local want = ffi.string(data, 3 * 4096 + 5)
    assert.are.equal(0, C.ws_copy_prefault(data + 1, 3 * 4096 + 4), detail())
    assert.are.equal(want, ffi.string(data, 3 * 4096 + 5))
    assert.are.equal(0, C.ws_copy_prefault(data, 0))
  end)
end)
