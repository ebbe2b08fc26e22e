-- CUDA IPC between two processes on one GPU (host/cuda_memory.c): a buffer
-- exported here is imported by a child wsync, which copies out of it with the
-- batched kernel, checks the values, and writes back into it; the steady
-- state (many launches, a second import of the same handle) makes no
-- cudaIpcOpenMemHandle call; a child's stream waits on the device for a word
-- this process writes (stream memory operations on an IPC mapping); closing
-- everything brings device free memory back to its baseline. Without a usable device the file is pending.
local ffi = require("ffi")
local support = require("tests.gpu.support")
local process = require("tests.helpers.process")
local cuda = require("wsync._cuda")

local count, reason = support.devices()

local MiB = 1024 * 1024
local BYTES = 64 * MiB
local NAME = "model.layers.0.mlp.experts.gate_up_proj"

-- The importer: maps the handle, opens it again (shared: no new call), runs a
-- copy plan out of the mapping `LAUNCHES` times, checks the copy holds the
-- exporter's synthetic values, writes 0x5a over the mapping's first 4096
-- bytes, closes everything and prints its counters.
local IMPORTER = [[
local cuda = require("wsync._cuda")
local handle_hex, bytes, name, version, launches = ...
bytes, version, launches = tonumber(bytes), tonumber(version), tonumber(launches)
local handle = handle_hex:gsub("%x%x", function(pair) return string.char(tonumber(pair, 16)) end)
local function say(key, value) io.write(key, "=", tostring(value), "\n") end
local mapping = assert(cuda.import(0, handle, bytes))
local opens_after_first = cuda.counters().ipc_opens
local again = assert(cuda.import(0, handle, bytes))
say("same_pointer", mapping:pointer() == again:pointer())
local stream = assert(cuda.stream(0))
local copy = assert(cuda.buffer(0, bytes))
local plan = assert(cuda.copy_plan(0, { copy, mapping }, { { target = 1, source = 2, width = bytes } }))
for _ = 1, launches do
  assert(plan:launch(stream))
end
assert(stream:synchronize())
local check = assert(cuda.synth_plan(0, { copy }, { { region = 1, name = name, elements = bytes / 2 } }))
assert(check:check(version, stream))
say("mismatches", assert(check:result()).mismatches)
assert(mapping:fill(0, 4096, 0x5a, stream))
assert(stream:synchronize())
local counters = cuda.counters()
say("opens_after_first", opens_after_first)
say("ipc_opens", counters.ipc_opens)
say("mappings_reused", counters.mappings_reused)
say("launches", counters.launches)
assert(check:close())
assert(plan:close())
assert(copy:close())
assert(again:close())
say("closes_after_one", cuda.counters().ipc_closes)
assert(mapping:close())
assert(stream:close())
counters = cuda.counters()
say("ipc_closes", counters.ipc_closes)
say("live_mappings", counters.live_mappings)
say("live_bytes", counters.live_bytes)
]]

-- The waiter: maps the gate (a small buffer whose first word the parent
-- writes) and the data, queues on its stream a device wait for word 0 to
-- reach 1, a copy of the data, and a write of 2 to word 1; says "queued",
-- then waits for its stream and checks the copy.
local WAITER = [[
local cuda = require("wsync._cuda")
local gate_hex, data_hex, bytes, name, version = ...
bytes, version = tonumber(bytes), tonumber(version)
local function unhex(text) return (text:gsub("%x%x", function(pair) return string.char(tonumber(pair, 16)) end)) end
local gate = assert(cuda.import(0, unhex(gate_hex), 4096))
local data = assert(cuda.import(0, unhex(data_hex), bytes))
local stream = assert(cuda.stream(0))
local copy = assert(cuda.buffer(0, bytes))
local plan = assert(cuda.copy_plan(0, { copy, data }, { { target = 1, source = 2, width = bytes } }))
assert(stream:wait_value(gate, 0, 1))
assert(plan:launch(stream))
assert(stream:write_value(gate, 4, 2))
io.write("queued\n")
io.stdout:flush()
assert(stream:synchronize())
local check = assert(cuda.synth_plan(0, { copy }, { { region = 1, name = name, elements = bytes / 2 } }))
assert(check:check(version, stream))
io.write("mismatches=", tostring(assert(check:result()).mismatches), "\n")
for _, object in ipairs({ check, plan, copy, stream, data, gate }) do assert(object:close()) end
]]

local function parse(stdout)
  local values = {}
  for key, value in stdout:gmatch("([%w_]+)=([^\n]*)\n") do
    values[key] = value
  end
  return values
end

describe("cuda IPC between processes", function()
  if count == 0 then
    pending("no CUDA device: " .. reason)
    return
  end

  local stream
  setup(function()
    stream = assert(cuda.stream(0))
  end)
  teardown(function()
    assert(stream:close())
  end)

  local function filled_buffer(version)
    local buffer = assert(cuda.buffer(0, BYTES))
    local plan = assert(cuda.synth_plan(0, { buffer }, { { region = 1, name = NAME, elements = BYTES / 2 } }))
    assert(plan:fill(version, stream))
    assert(stream:synchronize())
    assert(plan:close())
    return buffer
  end

  it("exports a buffer once and hands the same 64-byte handle every time", function()
    local buffer = filled_buffer(1)
    local before = cuda.counters().exports
    local handle = assert(buffer:export())
    assert.are.equal(64, #handle)
    assert.are.equal(handle, assert(buffer:export()))
    assert.are.equal(before + 1, cuda.counters().exports)
    assert(buffer:close())
  end)

  it("round-trips: the child maps once, copies the values out, writes back, and closes every mapping", function()
    local buffer = filled_buffer(5)
    local handle = assert(buffer:export())
    local launches = 100
    local result = process.wsync({ "-e", IMPORTER, support.hex(handle), tostring(BYTES), NAME, "5",
      tostring(launches) }, nil, { timeout = 120000 })
    assert.are.equal(0, result.code, result.stderr .. result.stdout)
    local values = parse(result.stdout)
    assert.are.equal("true", values.same_pointer)
    assert.are.equal("0", values.mismatches)
    -- one cudaIpcOpenMemHandle for the buffer, whatever the launches and the
    -- second import
    assert.are.equal("1", values.opens_after_first)
    assert.are.equal("1", values.ipc_opens)
    assert.are.equal("1", values.mappings_reused)
    assert.are.equal(tostring(launches + 1), values.launches)
    assert.are.equal("0", values.closes_after_one)
    assert.are.equal("1", values.ipc_closes)
    assert.are.equal("0", values.live_mappings)
    assert.are.equal("0", values.live_bytes)
    -- what the child wrote through its mapping is in our buffer
    assert.are.equal(string.rep("\90", 4096), assert(buffer:read(0, 4096)))
    local rest = assert(buffer:read(4096, 4096))
    local want = support.bytes(4096)
    assert(support.C.ws_synth_fill(want, support.C.WS_DTYPE_BFLOAT16, support.C.ws_synth_seed(NAME, #NAME), 2048,
      2048, 5) == 0)
    support.assert_same(ffi.string(want, 4096), rest, "the bytes after the child's write")
    assert(buffer:close())
  end)

  it("lets a child's stream wait on the device for a word this process writes, and write one back", function()
    local data = filled_buffer(3)
    local gate = assert(cuda.buffer(0, 4096))
    assert(gate:fill(0, 4096, 0, stream))
    assert(stream:synchronize())
    local child = process.start(process.wsync_binary(), { "-e", WAITER, support.hex(assert(gate:export())),
      support.hex(assert(data:export())), tostring(BYTES), NAME, "3" })
    local ok, err = pcall(function()
      process.drive(function()
        return child.stdout:find("queued\n", 1, true) ~= nil or child.done
      end, 60000, "the waiter's queued work")
      assert.is_nil(child.code, child.stderr)
      -- (Its stream waits on the device: the copy and the write have not run.)
      require("luv").sleep(200)
      assert.are.equal(string.rep("\0", 8), assert(gate:read(0, 8)))
      assert(stream:write_value(gate, 0, 1))
      process.drive(function()
        return child.done
      end, 60000, "the waiter's end")
      assert.are.equal(0, child.code, child.stderr .. child.stdout)
      assert.matches("mismatches=0\n", child.stdout, 1, true)
      assert.are.equal("\1\0\0\0\2\0\0\0", assert(gate:read(0, 8)))
    end)
    process.finish(child)
    assert(gate:close())
    assert(data:close())
    assert(ok, err)
  end)

  it("refuses a word outside its region or unaligned, before queueing anything", function()
    local gate = assert(cuda.buffer(0, 4096))
    for _, offset in ipairs({ 4094, 4096, 2 }) do
      local ok, message, code = stream:wait_value(gate, offset, 1)
      assert.is_nil(ok)
      assert.are.equal("EINVAL", code)
      assert.matches("4-byte aligned, inside it", message, 1, true)
    end
    assert(gate:close())
  end)

  it("refuses an import that claims more bytes than the exporter allocated", function()
    local buffer = filled_buffer(1)
    local handle = assert(buffer:export())
    local result = process.wsync({ "-e", [[
      local cuda = require("wsync._cuda")
      local handle_hex, bytes = ...
      local handle = handle_hex:gsub("%x%x", function(pair) return string.char(tonumber(pair, 16)) end)
      local mapping, message, code = cuda.import(0, handle, tonumber(bytes))
      print(mapping == nil, code, message)
      print(cuda.counters().live_mappings)]], support.hex(handle), tostring(BYTES + 4096) }, nil, { timeout = 60000 })
    assert.are.equal(0, result.code, result.stderr)
    assert.matches("^true\tEINVAL\tcuda: import on device 0: the exported buffer holds %d+ bytes, not "
      .. (BYTES + 4096), result.stdout)
    assert.matches("\n0\n$", result.stdout)
    assert(buffer:close())
  end)

  it("exports the allocation that holds memory allocated elsewhere, with where the memory starts in it", function()
    -- (A sub-range of a buffer stands for a torch tensor in a segment of torch's
    -- caching allocator: what export_region gets is a pointer and a size.)
    local buffer = filled_buffer(3)
    local region = buffer:region()
    local inner = { pointer = region.pointer + 8 * MiB, size = 4 * MiB, device = 0 }
    local handle, allocation_size, offset = cuda.export_region(inner)
    assert(handle, allocation_size)
    assert.are.equal(64, #handle)
    assert.are.equal(BYTES, allocation_size)
    assert.are.equal(8 * MiB, offset)
    -- the child maps the whole allocation and reads the values at the offset
    local result = process.wsync({ "-e", [[
      local cuda = require("wsync._cuda")
      local handle_hex, bytes, offset = ...
      local handle = handle_hex:gsub("%x%x", function(pair) return string.char(tonumber(pair, 16)) end)
      local mapping = assert(cuda.import(0, handle, tonumber(bytes)))
      io.write((assert(mapping:read(tonumber(offset), 4096))))
      assert(mapping:close())]], support.hex(handle), tostring(allocation_size), tostring(offset) }, nil,
      { timeout = 60000 })
    assert.are.equal(0, result.code, result.stderr)
    support.assert_same(assert(buffer:read(8 * MiB, 4096)), result.stdout, "the bytes the child read at the offset")
    assert(buffer:close())
  end)

  it("refuses to export memory that is not device memory, or runs past its allocation, naming it", function()
    local host = ffi.new("uint8_t[4096]")
    local handle, message, code = cuda.export_region({ pointer = tonumber(ffi.cast("uintptr_t", host)), size = 4096,
      device = 0 })
    assert.is_nil(handle)
    assert.are.equal("EINVAL", code)
    assert.matches("is not device memory", message, 1, true)
    local buffer = filled_buffer(1)
    local region = buffer:region()
    handle, message, code = cuda.export_region({ pointer = region.pointer + BYTES - 4096, size = 8192, device = 0 })
    assert.is_nil(handle)
    assert.are.equal("EINVAL", code)
    assert.matches("runs 4096 bytes past the end of its allocation", message, 1, true)
    assert(buffer:close())
  end)

  it("answers a handle that is no exported buffer with CUDA's own error name", function()
    local result = process.wsync({ "-e", [[
      local cuda = require("wsync._cuda")
      local handle = string.rep("\7", 64)
      print(select(3, cuda.import(0, handle, 4096)), (select(2, cuda.import(0, handle, 4096))))]]
    }, nil, { timeout = 60000 })
    assert.are.equal(0, result.code, result.stderr)
    assert.matches("^ECUDA\tcuda: import of a 4096%-byte buffer on device 0: cudaIpcOpenMemHandle: cudaError%a+ %(",
      result.stdout)
  end)
end)

describe("cuda device memory after everything is closed", function()
  if count == 0 then
    pending("no CUDA device: " .. reason)
    return
  end

  -- One of everything: buffers, a stream, events, plans of both kinds, and
  -- an import in a child; every launch finished and every object closed.
  local function cycle(hold)
    local stream = assert(cuda.stream(0))
    local start, done = assert(cuda.event(0, true)), assert(cuda.event(0, true))
    local a, b = assert(cuda.buffer(0, 256 * MiB)), assert(cuda.buffer(0, 256 * MiB))
    local copy = assert(cuda.copy_plan(0, { a, b }, { { target = 1, source = 2, width = 256 * MiB } }))
    local synth = assert(cuda.synth_plan(0, { b }, { { region = 1, name = "t", elements = 128 * MiB } }))
    assert(start:record(stream))
    assert(synth:fill(1, stream))
    assert(copy:launch(stream))
    assert(done:record(stream))
    assert(done:synchronize())
    assert.is_true(assert(done:query()))
    assert.is_true(assert(done:elapsed(start)) >= 0)
    local handle = assert(b:export())
    local result = process.wsync({ "-e", [[
      local cuda = require("wsync._cuda")
      local handle = (...):gsub("%x%x", function(pair) return string.char(tonumber(pair, 16)) end)
      local mapping = assert(cuda.import(0, handle, 4096))
      assert(mapping:close())]], support.hex(handle) }, nil, { timeout = 60000 })
    assert.are.equal(0, result.code, result.stderr)
    if hold then
      hold()
    end
    for _, object in ipairs({ synth, copy, a, b, start, done, stream }) do
      assert(object:close())
    end
  end

  it("is back at its baseline, and the buffers were really there", function()
    cycle() -- loads the kernels and creates the context: not part of the baseline
    collectgarbage()
    local baseline = support.free_bytes(0)
    local held
    cycle(function()
      held = support.free_bytes(0)
    end)
    for _ = 1, 3 do
      cycle()
    end
    collectgarbage()
    local after = support.free_bytes(0)
    assert.is_true(baseline - held >= 512 * MiB, string.format("holding 512 MiB took only %d bytes", baseline - held))
    assert.is_true(math.abs(after - baseline) <= 2 * MiB,
      string.format("free memory %d bytes after, %d before", after, baseline))
    local counters = cuda.counters()
    assert.are.equal(0, counters.live_bytes)
    assert.are.equal(0, counters.live_mappings)
    assert.are.equal(counters.allocations, counters.frees)
  end)
end)
