-- Soak: 1,000 demo publications in a row on the host backend (two synthetic
-- ranks, TP2 reference runtime, the whole memory schedule), this process
-- being the host. The Lua heap of every process after a full collection
-- (the host, both trainer ranks, the runtime's main process and its TP
-- workers) must stay flat from publication 50 on: a per-publication leak of
-- even 100 bytes would add about 95 KiB by the end. (Before the fix of
-- wsync.loop's coroutine table each publication kept 30-48 KB in the host.)
-- The RSS figures of a longer run are in tests/bench/RESULTS.md
-- (tests/bench/soak.lua).
local async = require("tests.helpers.async")
local soak = require("tests.helpers.soak")

local PUBLICATIONS = 1000
local WARMUP = 50
-- Allowed growth of one process's heap between the first and the last
-- sample: LuaJIT's heap moves by some kilobytes with the interned strings
-- and traces of the moment.
local HEAP_BOUND = 64 * 1024

describe("1,000 publications in a row", function()
  it("keep the Lua heap of the host and of every trainer and runtime process flat", function()
    local samples
    async.run_async(function()
      samples = soak.run({ publications = PUBLICATIONS, warmup = WARMUP, every = 475 })
    end, 300000)
    assert.are.equal(WARMUP, samples[1].published)
    assert.are.equal(PUBLICATIONS, samples[#samples].published)
    local growth = soak.growth(samples)
    local roles = 0
    for role, grown in pairs(growth) do
      roles = roles + 1
      assert.is_true(grown.heap <= HEAP_BOUND, string.format("%s: the Lua heap grew by %d bytes over %d publications "
        .. "(%.0f bytes each)", role, grown.heap, PUBLICATIONS - WARMUP, grown.heap / (PUBLICATIONS - WARMUP)))
    end
    -- host, two trainer ranks, the runtime's main process, two TP workers
    assert.are.equal(6, roles)
  end)
end)
