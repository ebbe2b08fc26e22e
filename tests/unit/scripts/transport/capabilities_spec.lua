-- wsync.transport: every transport of the build against the interface and
-- the capabilities it declares (wsync.transport.INTERFACE, CAPABILITIES),
-- and the check itself on transports made wrong on purpose.
local transport = require("wsync.transport")
local util = require("wsync.util")

-- A copy of `module` with `changes` (false removes a field).
local function altered(module, changes)
  local copy = {}
  for key, value in pairs(module) do
    copy[key] = value
  end
  for key, value in pairs(changes) do
    copy[key] = value or nil
  end
  return copy
end

describe("wsync.transport: capabilities", function()
  for _, backend in ipairs(util.sorted_keys(transport.BY_BACKEND)) do
    it("the " .. backend .. " backend's transport has the interface and exactly what it declares", function()
      assert.are.same({}, transport.problems(transport.for_backend(backend)))
    end)
  end

  it("declares what each backend has", function()
    local shm, cuda = transport.for_backend("host"), transport.for_backend("cuda")
    assert.is_false(transport.can(shm, "gates") or transport.can(shm, "direct") or transport.can(shm, "device_check"))
    assert.is_true(transport.can(shm, "named_leftovers"))
    assert.is_true(transport.can(cuda, "gates") and transport.can(cuda, "direct") and transport.can(cuda,
      "device_check"))
    assert.are.same({ "shm" }, (function()
      local names = {}
      for index, module in ipairs(transport.with("named_leftovers")) do
        names[index] = module.NAME
      end
      return names
    end)())
  end)

  it("finds a transport that lacks, declares or hides what it should not", function()
    local cuda = transport.for_backend("cuda")
    assert.are.same({ "lacks load of the interface" }, transport.problems(altered(cuda, { load = false })))
    assert.are.same({ "declares gates but lacks import_gate" }, transport.problems(altered(cuda,
      { import_gate = false })))
    assert.are.same({ "has export_memories of direct without declaring it" }, transport.problems(altered(cuda,
      { CAPABILITIES = { gates = true, device_check = true } })))
    assert.are.same({ "declares an unknown capability telepathy" }, transport.problems(altered(cuda,
      { CAPABILITIES = { gates = true, direct = true, device_check = true, telepathy = true } })))
  end)

  it("refuses to be asked for a capability it does not know", function()
    assert.has_error(function()
      transport.can(transport.for_backend("host"), "gate")
    end)
  end)
end)
