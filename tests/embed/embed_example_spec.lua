-- tests/embed/embed_example.c through libwsync: it opens a host, checks that a
-- failing chunk reports its error, runs the smoke recipe with the override
-- greeting=embedded, and closes the host. What it prints is checked here.
--
-- The example's path comes from $WSYNC_EMBED_EXAMPLE, which CTest's embed tier
-- sets.
local uv = require("luv")
local process = require("tests.helpers.process")

local function example()
  local path = os.getenv("WSYNC_EMBED_EXAMPLE")
  assert(path ~= nil and path ~= "", "WSYNC_EMBED_EXAMPLE is not set: run this spec through CTest (ctest "
    .. "--test-dir build -R embed), or set it to the embed_example binary of the build")
  assert(uv.fs_access(path, "X"), "WSYNC_EMBED_EXAMPLE=" .. path .. " is not an executable file")
  return path
end

local function project_version()
  local file = assert(io.open("CMakeLists.txt"))
  local version = file:read("*a"):match("project%(wsync VERSION ([%d%.]+)")
  file:close()
  return version
end

local function describe_result(result)
  return string.format("exit %d\nstdout:\n%s\nstderr:\n%s", result.code, result.stdout, result.stderr)
end

describe("embed_example (libwsync's host API)", function()
  it("runs the smoke recipe with the override and says ok", function()
    local result = process.run({ program = example(), args = { "recipes/smoke.lua" } })
    assert.are.equal(0, result.code, describe_result(result))
    assert.are.equal("", result.stderr, describe_result(result))
    local lines = {}
    for line in result.stdout:gmatch("[^\n]+") do
      lines[#lines + 1] = line
    end
    -- The override reached the recipe: its default greeting did not print.
    assert.are.equal("smoke: embedded", lines[1], describe_result(result))
    assert.is_nil(result.stdout:find("hello from the smoke recipe", 1, true))
    assert.matches("^smoke: manifest %x+ %(3 records, 147584 bytes%)$", lines[2])
    assert.are.equal(64, #lines[2]:match("manifest (%x+)"))
    assert.are.equal("smoke: shared memory round-trip ok (1048576 bytes)", lines[3])
    assert.matches("^smoke: rank 0 %-> host device %x+%-%x+%-%x+%-%x+%-%x+$", lines[4])
    assert.matches("^smoke: rank 1 %-> host device ", lines[5])
    assert.are.equal("smoke: ok", lines[6])
    assert.are.equal("embed_example: ok (wsync " .. project_version() .. ")", lines[7])
    assert.are.equal(7, #lines, describe_result(result))
  end)

  it("reports a failing recipe through ws_host_error and exits 1", function()
    local result = process.run({ program = example(), args = { "tests/fixtures/recipes/runtime_error.lua" } })
    assert.are.equal(1, result.code, describe_result(result))
    assert.matches("embed_example: recipe failed: tests/fixtures/recipes/runtime_error.lua:3: steps are not "
      .. "computable", result.stderr, 1, true)
    assert.are.equal("embed_example: FAILED (wsync " .. project_version() .. ")\n", result.stdout)
  end)
end)
