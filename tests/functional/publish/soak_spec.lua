-- Soak: 1,000 demo publications in a row on the host backend (two synthetic
-- ranks, TP2 reference runtime, the whole memory schedule), in a wsync
-- process of its own that is the host. The Lua heap of every process after
-- a full collection (the host, both trainer ranks, the runtime's main
-- process and its TP workers) must stay flat from publication 50 on: a
-- per-publication leak of even 100 bytes would add about 95 KiB by the end.
-- (Before the fix of wsync.loop's coroutine table each publication kept
-- 30-48 KB in the host.) The host is not this process: its heap holds the
-- JIT traces that the specs before this one left, and the host's would then
-- grow with the traces the soak compiles on top of those, by more or less
-- with the order the specs ran in (with a seed that ran this spec first,
-- 70-85 KB). The RSS figures of a longer run are in tests/bench/RESULTS.md
-- (tests/bench/soak.lua).
local cjson = require("cjson")
local process = require("tests.helpers.process")

local PUBLICATIONS = 1000
local WARMUP = 50
-- Allowed growth of one process's heap between the first and the last
-- sample: LuaJIT's heap moves by some kilobytes with the interned strings
-- and traces of the moment.
local HEAP_BOUND = 64 * 1024

-- The host's chunk: the soak, then one line "soak: {first, last,
-- heap_growth = {role = bytes}}" (the publications of the first and the
-- last sample).
local SOAK = [[
package.path = "./?.lua;" .. package.path
local loop = require("wsync.loop")
local soak = require("tests.helpers.soak")
loop.spawn(function()
  local samples = soak.run({ publications = %d, warmup = %d, every = 475 })
  local growth = {}
  for role, grown in pairs(soak.growth(samples)) do
    growth[role] = grown.heap
  end
  io.stdout:write("soak: ", require("cjson").encode({ first = samples[1].published,
    last = samples[#samples].published, heap_growth = growth }), "\n")
end)
loop.run()
]]

describe("1,000 publications in a row", function()
  it("keep the Lua heap of the host and of every trainer and runtime process flat", function()
    local result = process.wsync({ "-e", SOAK:format(PUBLICATIONS, WARMUP) }, nil, { timeout = 300000 })
    assert.are.equal(0, result.code, result.stderr)
    local line = ("\n" .. result.stdout):match("\nsoak: (%b{})")
    assert.is_not_nil(line, result.stdout)
    local soaked = cjson.decode(line)
    assert.are.equal(WARMUP, soaked.first)
    assert.are.equal(PUBLICATIONS, soaked.last)
    local roles = 0
    for role, grown in pairs(soaked.heap_growth) do
      roles = roles + 1
      assert.is_true(grown <= HEAP_BOUND, string.format("%s: the Lua heap grew by %d bytes over %d publications "
        .. "(%.0f bytes each)", role, grown, PUBLICATIONS - WARMUP, grown / (PUBLICATIONS - WARMUP)))
    end
    -- host, two trainer ranks, the runtime's main process, two TP workers
    assert.are.equal(6, roles)
  end)
end)
