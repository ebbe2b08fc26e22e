-- wsync.transport.chunk_plans: a side's plans by chunk, each closed once
-- (when replaced or cleared), and the manifests of their segments.
local chunk_plans = require("wsync.transport.chunk_plans")
local manifest_module = require("wsync.native.manifest")

-- A transport that records the plans it closes.
local function recording_transport()
  local transport = { closed = {} }
  function transport.close_plan(plan)
    transport.closed[#transport.closed + 1] = plan or "nil"
  end
  return transport
end

-- Chunk plan `name` whose segment holds one record named `name`.
local function chunk(name, plan)
  local segment = assert(manifest_module.segment())
  assert(segment:add(name, "bfloat16", { 2, 3 }))
  return { segment = segment, plan = plan }
end

describe("wsync.transport.chunk_plans", function()
  it("closes the plan a chunk's new one replaces, and every plan when cleared", function()
    local transport = recording_transport()
    local plans = chunk_plans.new(transport)
    local first = chunk("a", "plan a")
    plans:put(1, first)
    plans:put(2, chunk("b", nil))
    assert.are.equal(first, plans:get(1))
    assert.are.equal(2, plans:count())
    plans:put(1, chunk("c", "plan c"))
    assert.are.same({ "plan a" }, transport.closed)
    assert.are.equal("wsync.manifest_segment (closed)", tostring(first.segment))
    plans:clear()
    table.sort(transport.closed)
    assert.are.same({ "nil", "plan a", "plan c" }, transport.closed)
    assert.is_nil(plans:get(1))
    assert.are.equal(0, plans:count())
  end)

  it("hashes the chunks' segments in the order asked, again after a chunk changed", function()
    local plans = chunk_plans.new(recording_transport())
    plans:put(1, chunk("a"))
    plans:put(2, chunk("b"))
    local expected = manifest_module.of({ { "b", "bfloat16", { 2, 3 } }, { "a", "bfloat16", { 2, 3 } } })
    local manifest = assert(plans:manifest({ 2, 1 }))
    assert.are.equal(expected.digest, manifest.digest)
    assert.are.equal(2, manifest.count)
    plans:put(1, chunk("c"))
    local changed = assert(plans:manifest({ 2, 1 }))
    assert.are.equal(manifest_module.of({ { "b", "bfloat16", { 2, 3 } }, { "c", "bfloat16", { 2, 3 } } }).digest,
      changed.digest)
    plans:clear()
  end)
end)
