-- A host removes the /dev/shm segments that this user's processes left when
-- they died without removing them (SIGKILL), as it removes their control
-- directories: `wsync-<pid>-<hex>` files whose pid is gone.
local uv = require("luv")
local process = require("tests.helpers.process")

-- The pid of a process that has exited (and been reaped).
local function dead_pid()
  local result = process.run({ program = "/bin/sh", args = { "-c", "echo $$" } })
  return tonumber(result.stdout:match("%d+"))
end

describe("a host starting a session", function()
  it("removes segments that dead processes of this user left in /dev/shm, saying so", function()
    local pid = dead_pid()
    assert.is_nil(uv.fs_stat("/proc/" .. pid))
    local path = string.format("/dev/shm/wsync-%d-0123456789abcdef", pid)
    local file = assert(io.open(path, "wb"))
    file:write("left behind")
    file:close()
    local alive = string.format("/dev/shm/wsync-%d-fedcba9876543210", uv.os_getpid())
    file = assert(io.open(alive, "wb"))
    file:write("still in use")
    file:close()
    local result = process.wsync({ "run", "recipes/demo.lua" }, nil, { timeout = 60000 })
    local kept = uv.fs_stat(alive) ~= nil
    os.remove(alive)
    os.remove(path)
    assert.are.equal(0, result.code, result.stderr)
    assert.matches(string.format("removed %s, left by pid %d, which is gone (11 bytes)", path, pid), result.stdout, 1,
      true)
    assert.is_true(kept, "a live process's segment is kept")
  end)
end)
