-- Status codes, names and messages of the C core, and the per-thread detail.
local ffi = require("ffi")
local C = require("wsync.native.ffi")

-- The X-macro table as written in host/status_defs.h, read from the source so
-- that this spec checks the compiled lookups against it instead of restating it.
local function status_rows()
  local file = assert(io.open("host/status_defs.h", "r"))
  local text = file:read("*a")
  file:close()
  local rows = {}
  for name, value, message in text:gmatch('X%((%u+),%s*(%-?%d+),%s*"([^"]*)"%)') do
    rows[#rows + 1] = { name = name, value = tonumber(value), message = message }
  end
  return rows
end

describe("status table", function()
  local rows = status_rows()

  it("is read from host/status_defs.h and has the codes the core relies on", function()
    local by_name = {}
    for _, row in ipairs(rows) do
      by_name[row.name] = row.value
    end
    assert.is_true(#rows >= 14, "only " .. #rows .. " rows parsed")
    assert.are.equal(0, by_name.OK)
    assert.are.equal(-1, by_name.EINVAL)
    assert.is_number(by_name.ESTATE)
    assert.is_number(by_name.ENODEV)
  end)

  it("gives every code its name, its message and its enum value", function()
    for _, row in ipairs(rows) do
      assert.are.equal(row.name, ffi.string(C.ws_status_name(row.value)))
      assert.are.equal(row.message, ffi.string(C.ws_status_message(row.value)))
      assert.are.equal(row.value, tonumber(C["WS_" .. row.name]))
      assert.are_not.equal("", row.message)
    end
  end)

  it("has unique names and numbers; only OK is zero, the rest negative", function()
    local names, values = {}, {}
    for _, row in ipairs(rows) do
      assert.is_nil(names[row.name], "duplicate name " .. row.name)
      assert.is_nil(values[row.value], "duplicate value " .. row.value)
      names[row.name], values[row.value] = true, true
      if row.name == "OK" then
        assert.are.equal(0, row.value)
      else
        assert.is_true(row.value < 0, row.name .. " is not negative")
      end
    end
  end)

  it("answers EUNKNOWN and 'unknown status' for codes outside the table", function()
    for _, code in ipairs({ 1, 7, -15, -999, 2147483647, -2147483647 - 1 }) do
      assert.are.equal("EUNKNOWN", ffi.string(C.ws_status_name(code)))
      assert.are.equal("unknown status", ffi.string(C.ws_status_message(code)))
    end
  end)
end)

describe("ws_error_detail", function()
  it("holds the detail of the last failure and is cleared by ws_clear_error", function()
    local out = ffi.new("ws_shm *[1]")
    assert.are.equal(C.WS_EINVAL, C.ws_shm_create(0, out))
    assert.matches("size", ffi.string(C.ws_error_detail()))
    C.ws_clear_error()
    assert.are.equal("", ffi.string(C.ws_error_detail()))
  end)

  it("is empty after a call that succeeds", function()
    local out = ffi.new("ws_shm *[1]")
    assert.are.equal(C.WS_EINVAL, C.ws_shm_create(0, out))
    assert.are_not.equal("", ffi.string(C.ws_error_detail()))
    local count = ffi.new("int[1]")
    assert.are.equal(0, C.ws_device_count(C.WS_BACKEND_HOST, count))
    assert.are.equal("", ffi.string(C.ws_error_detail()))
  end)
end)
