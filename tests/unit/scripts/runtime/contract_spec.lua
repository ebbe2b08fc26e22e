-- The runtime contract (wsync.runtime.contract) on the cases of
-- tests/fixtures/contract/*.json, which the vllm runtime's Python twin is
-- tested on too (tests/python/test_contract.py): the same code and the same
-- message for every case, so that the two cannot drift apart.
local cjson = require("cjson")
local contract = require("wsync.runtime.contract")
local errors = require("wsync.errors")

local function fixture(name)
  local file = assert(io.open("tests/fixtures/contract/" .. name .. ".json", "r"))
  local text = file:read("*a")
  file:close()
  return cjson.decode(text)
end

-- JSON's null as Lua's nil, everywhere in `value`.
local function plain(value)
  if value == cjson.null then
    return nil
  elseif type(value) == "table" then
    local out = {}
    for key, item in pairs(value) do
      out[key] = plain(item)
    end
    return out
  end
  return value
end

local function changed(value, changes, remove)
  local out = require("wsync.util").merged(value, changes)
  for _, key in ipairs(remove or {}) do
    out[key] = nil
  end
  return out
end

-- Runs `check`; asserts the case's code, message, rank and fatality.
local function expect(case, fatal, check, ...)
  local ok, err = pcall(check, ...)
  if case.code == nil then
    assert.is_true(ok, case.name .. ": " .. tostring(err))
    return
  end
  assert.is_false(ok, case.name .. ": accepted")
  assert.is_true(errors.is(err), case.name .. ": not a wsync error: " .. tostring(err))
  assert.are.equal(case.code, err.code, case.name)
  assert.are.equal(case.message, err.message, case.name)
  assert.are.equal(case.rank, err.rank, case.name)
  assert.are.equal(fatal or nil, err.fatal, case.name)
end

describe("runtime contract: the shared cases", function()
  it("checks each header case as the fixture says", function()
    local data = plain(fixture("header"))
    assert.is_true(#data.cases > 10)
    for _, case in ipairs(data.cases) do
      local runtime = changed(data.runtime, case.runtime)
      local header = case.header
      if header == nil then
        header = changed(data.header, case.changes, case.remove)
      end
      expect(case, true, contract.check_header, header, runtime)
    end
  end)

  it("checks each receipts case as the fixture says", function()
    local raw = fixture("receipts")
    local data = plain(raw)
    assert.is_true(#data.cases > 10)
    for index, case in ipairs(data.cases) do
      local receipts = case.receipts
      if receipts == nil then
        receipts = {}
        for rank, receipt in ipairs(data.receipts) do
          receipts[rank] = receipt
        end
      end
      if case.receipt ~= nil then
        receipts[case.receipt + 1] = changed(receipts[case.receipt + 1], case.changes, case.remove)
      end
      -- (A case's "resident_tensors": null means none expected; absent, the base's.)
      local resident = data.resident_tensors
      if raw.cases[index].resident_tensors ~= nil then
        resident = case.resident_tensors
      end
      expect(case, true, contract.check_receipts, data.header, receipts, resident)
    end
  end)

  it("checks each finish case as the fixture says", function()
    local data = plain(fixture("finish"))
    for _, case in ipairs(data.cases) do
      local result = changed(data.result, case.changes, case.remove)
      if case.receipt ~= nil then
        local receipts = {}
        for rank, receipt in ipairs(result.receipts) do
          receipts[rank] = receipt
        end
        receipts[case.receipt + 1] = changed(receipts[case.receipt + 1], case.receipt_changes)
        result.receipts = receipts
      end
      -- (Only the receipts' own failures are fatal: a wrong commit is the host's refusal.)
      expect(case, case.receipt ~= nil, contract.check_finish, data.header, result)
    end
  end)

  it("shows values as the Python side does", function()
    local shown = {}
    for index, value in ipairs({ true, false, 3, 2.5, "x", { 1 } }) do
      shown[index] = contract.show(value)
    end
    assert.are.same({ "true", "false", "3", "2.5", "x", "(a table)" }, shown)
    assert.are.equal("nil", contract.show(nil))
  end)
end)
