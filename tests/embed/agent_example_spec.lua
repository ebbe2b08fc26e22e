-- tests/embed/agent_example.c, a trainer rank in C on libwsync's agent API,
-- in its --self-check mode: what the API does without a wsync host (open
-- failures and ws_last_error, per thread; registration against an endpoint
-- that accepts and never answers; the synthetic values compiled into the
-- example; an agent that outlives its host and finds the host's link
-- cleared). The publications end to end, with a host and two ranks, are
-- tests/functional/trainer/agent_api_spec.lua.
--
-- The example's path comes from $WSYNC_AGENT_EXAMPLE, which CTest's embed and
-- functional tiers set.
local uv = require("luv")
local process = require("tests.helpers.process")

local function example()
  local path = os.getenv("WSYNC_AGENT_EXAMPLE")
  assert(path ~= nil and path ~= "", "WSYNC_AGENT_EXAMPLE is not set: run this spec through CTest (ctest "
    .. "--test-dir build -R embed), or set it to the agent_example binary of the build")
  assert(uv.fs_access(path, "X"), "WSYNC_AGENT_EXAMPLE=" .. path .. " is not an executable file")
  return path
end

-- The example's endpoint directories in /tmp, as a set.
local function endpoint_directories()
  local names = {}
  local scan = uv.fs_scandir("/tmp")
  while scan do
    local name = uv.fs_scandir_next(scan)
    if not name then
      break
    end
    if name:match("^wsync%-agent%-example%-") then
      names[name] = true
    end
  end
  return names
end

describe("agent_example --self-check (libwsync's agent API without a host)", function()
  it("passes every check and leaves no endpoint behind", function()
    local before = endpoint_directories()
    local result = process.run({ program = example(), args = { "--self-check" } })
    local text = string.format("exit %d\nstdout:\n%s\nstderr:\n%s", result.code, result.stdout, result.stderr)
    assert.are.equal(0, result.code, text)
    assert.are.equal("", result.stderr, text)
    assert.are.equal("agent_example: self-check ok (25 tensors registered, 405248 bytes)\n", result.stdout)
    local left = {}
    for name in pairs(endpoint_directories()) do
      if not before[name] then
        left[#left + 1] = "/tmp/" .. name
      end
    end
    assert.are.same({}, left, "the self-check left its endpoint directory")
  end)

  it("refuses a wrong command line with its usage", function()
    local result = process.run({ program = example(), args = { "--self-check", "extra" } })
    assert.are.equal(2, result.code)
    assert.matches("usage: agent_example ENDPOINT RANK WORLD VERSIONS", result.stderr, 1, true)
    assert.matches("agent_example --self-check", result.stderr, 1, true)
  end)
end)
