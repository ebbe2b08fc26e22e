-- tests/helpers/preload.lua, the leak check every tier runs after each test,
-- proved able to fail: `wsync test` on a fixture folder whose specs leak on
-- purpose (tests/fixtures/leaking_spec) must fail exactly the leaking tests,
-- name each test and what it left, and end what they left.
local uv = require("luv")
local process = require("tests.helpers.process")
local shm_files = require("tests.helpers.shm")

local fixture = "tests/fixtures/leaking_spec"
local file = fixture .. "/leaks_spec.lua"

-- The failure line the preload writes for the test `name` of the fixture's
-- first describe; returns what it says was left.
local function left_by(output, name)
  local prefix = string.format("leak check: test '%s: a leaking fixture spec %s' did not clean up: ", file, name)
  local start, finish = output:find(prefix, 1, true)
  assert(start, "no leak reported for '" .. name .. "' in:\n" .. output)
  return output:sub(finish + 1):match("^[^\n]*")
end

describe("the leak-check preload", function()
  local result

  setup(function()
    result = process.wsync({ "test", fixture })
  end)

  it("makes `wsync test` fail, with one error per leak and the other tests passing", function()
    assert.are_not.equal(0, result.code)
    assert.matches("8 successes / 0 failures / 5 errors / 0 pending", result.stdout, 1, true)
  end)

  it("names a leaked timer and the test that leaked it", function()
    assert.matches("^1 libuv handle active: uv_timer_t: 0x%x+$", left_by(result.stdout, "leaks a timer"))
  end)

  it("names a leaked shared-memory segment of its own process, and unlinks it", function()
    local left = left_by(result.stdout, "leaks a shared-memory segment")
    local name = left:match("^1 shared%-memory segment: /dev/shm(/wsync%-%d+%-%x+)$")
    assert.is_string(name, left)
    assert.is_nil(shm_files.stat(name), name .. " was left in /dev/shm")
  end)

  it("names a leaked child process with its pid, and kills it", function()
    local left = left_by(result.stdout, "leaks a child process")
    local pid = tonumber(left:match("^1 libuv handle active: uv_process_t: 0x%x+ pid (%d+)$"))
    assert.is_number(pid, left)
    assert.is_nil(uv.fs_stat("/proc/" .. pid), "the leaked child " .. pid .. " is still alive")
  end)

  it("names a changed working directory, and changes it back for the next test", function()
    local left = left_by(result.stdout, "changes the working directory")
    assert.are.equal(string.format("the working directory changed to / (from %s)", uv.cwd()), left)
    -- The test after it found nothing active and the directory restored.
    assert.is_nil(result.stdout:find("runs clean after them", 1, true), result.stdout)
  end)

  it("does not count the loop's own spin handle, nor a handle a describe's setup keeps for its tests", function()
    assert.is_nil(result.stdout:find("ends inside a spin window", 1, true), result.stdout)
    assert.is_nil(result.stdout:find("sees the timer active", 1, true), result.stdout)
  end)

  it("names the spec file whose setup left a handle that its teardown did not close", function()
    assert.matches(string.format("leak check: %s did not clean up: 1 libuv handle active: uv_timer_t: 0x%%x+\n",
      (file:gsub("%p", "%%%0"))), result.stdout)
  end)
end)
