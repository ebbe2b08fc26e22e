-- wsync.control.endpoint: what it cannot clean up is reported, not dropped;
-- the leftovers of hosts that died are removed.
local uv = require("luv")
local endpoint_module = require("wsync.control.endpoint")

local function scratch()
  return assert(uv.fs_mkdtemp((os.getenv("TMPDIR") or "/tmp") .. "/wsync-test-XXXXXX"))
end

describe("wsync.control.endpoint", function()
  it("closes cleanly, and reports a control directory it cannot remove", function()
    local parent = scratch()
    local clean = endpoint_module.listen({ parent = parent, handlers_for = function() return {} end })
    assert.are.same({}, clean:close())
    assert.is_nil(uv.fs_stat(clean.directory))

    local endpoint = endpoint_module.listen({ parent = parent, handlers_for = function() return {} end })
    -- Someone put a file into the private directory: rmdir fails.
    local stray = endpoint.directory .. "/stray"
    assert(io.open(stray, "w")):close()
    local failures = endpoint:close()
    uv.run("nowait")
    assert.are.equal(1, #failures)
    assert.matches("^cannot remove the control directory " .. endpoint.directory:gsub("%p", "%%%0") .. ": ENOTEMPTY",
      failures[1])
    os.remove(stray)
    assert(uv.fs_rmdir(endpoint.directory))
    assert(uv.fs_rmdir(parent))
  end)

  it("removes the directories of hosts that are gone, and no other", function()
    local parent = scratch()
    -- A pid that is gone: a child that has exited and been reaped.
    local handle, gone
    handle, gone = uv.spawn("true", {}, function()
      handle:close()
    end)
    while not handle:is_closing() do
      uv.run("once")
    end
    uv.run("nowait")
    local dead = string.format("%s/wsync-%d-abcdef", parent, gone)
    local alive = string.format("%s/wsync-%d-ghijkl", parent, uv.os_getppid())
    local other = parent .. "/wsync-notapid-xyzxyz"
    for _, path in ipairs({ dead, alive, other }) do
      assert(uv.fs_mkdir(path, tonumber("700", 8)))
    end
    local lines = {}
    local removed = endpoint_module.remove_leftovers(parent, function(line)
      lines[#lines + 1] = line
    end)
    assert.are.same({ dead }, removed)
    assert.are.same({ string.format("removed %s, left by host pid %d, which is gone", dead, gone) }, lines)
    assert.is_nil(uv.fs_stat(dead))
    assert.is_table(uv.fs_stat(alive))
    assert(uv.fs_rmdir(alive))
    assert(uv.fs_rmdir(other))
    assert(uv.fs_rmdir(parent))
  end)
end)
