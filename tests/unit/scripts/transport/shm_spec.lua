-- wsync.transport.shm's removal of the names its creators can no longer
-- remove (after a rank was killed): by descriptor, and by the pid in a
-- segment's name, whatever the segment holds.
local uv = require("luv")
local shm_transport = require("wsync.transport.shm")
local shm = require("wsync.native.shm")

-- A pid that no process has (the segments' creator, killed).
local function dead_pid()
  for pid = 4000000, 4100000 do
    if not uv.fs_stat("/proc/" .. pid) then
      return pid
    end
  end
  error("no free pid found")
end

local function exists(name)
  return uv.fs_stat("/dev/shm/" .. name:gsub("^/", "")) ~= nil
end

describe("wsync.transport.shm.remove_leftovers", function()
  it("removes an empty segment of a killed rank (named, never sized), which no open accepts", function()
    local pid = dead_pid()
    local name = string.format("wsync-%d-%016x", pid, math.random(0, 0x7fffffff))
    local fd = assert(uv.fs_open("/dev/shm/" .. name, "w", tonumber("600", 8)))
    uv.fs_close(fd)
    assert.is_nil(shm.open("/" .. name))
    local removed, failures = shm_transport.remove_leftovers(nil, { [pid] = true })
    assert.are.same({}, failures)
    assert.are.same({ "/" .. name }, removed)
    assert.is_false(exists(name))
  end)

  it("removes the names in descriptors and leaves a mapping of them valid", function()
    local buffer = assert(shm.create(4096))
    local name = buffer:name()
    buffer:write(0, "still mapped")
    local removed, failures = shm_transport.remove_leftovers({ { name, "/wsync-1-00000000000000ff" } }, nil)
    assert.are.same({}, failures)
    assert.are.same({ name }, removed) -- (a name that is not there is no failure)
    assert.is_false(exists(name))
    assert.are.equal("still mapped", buffer:read(0, 12))
    buffer:close()
  end)
end)
