-- wsync.util.program: the wsync binary a host starts its roles with, in the
-- wsync binary itself and in a process that embeds libwsync (faked here by
-- giving wsync._core another image).
local uv = require("luv")
local core = require("wsync._core")
local util = require("wsync.util")

describe("wsync.util.program", function()
  local image = core.image

  after_each(function()
    core.image = image
  end)

  it("is the running executable in the wsync binary", function()
    assert.are.equal(uv.exepath(), util.program())
  end)

  it("is the wsync beside libwsync in an embedding process", function()
    local directory = uv.exepath():match("^(.*)/[^/]*$")
    core.image = directory .. "/libwsync.so"
    assert.are.equal(directory .. "/wsync", util.program())
  end)

  it("says where it looked when an embedding process has no wsync binary", function()
    core.image = "/nonexistent/lib/libwsync.so"
    local path, program = os.getenv("PATH"), os.getenv("WSYNC_PROGRAM")
    uv.os_setenv("PATH", "/nonexistent/bin")
    uv.os_unsetenv("WSYNC_PROGRAM")
    local ok, err = pcall(util.program)
    uv.os_setenv("PATH", path)
    if program then
      uv.os_setenv("WSYNC_PROGRAM", program)
    end
    assert.is_false(ok)
    assert.are.equal("PROGRAM_NOT_FOUND", err.code)
    assert.matches("tried $WSYNC_PROGRAM, /nonexistent/lib/wsync, wsync on PATH", err.message, 1, true)
    assert.matches("set WSYNC_PROGRAM to the wsync binary", err.message, 1, true)
  end)

  it("refuses a WSYNC_PROGRAM that is not an executable", function()
    core.image = "/nonexistent/lib/libwsync.so"
    local program = os.getenv("WSYNC_PROGRAM")
    uv.os_setenv("WSYNC_PROGRAM", "/nonexistent/wsync")
    local ok, err = pcall(util.program)
    if program then
      uv.os_setenv("WSYNC_PROGRAM", program)
    else
      uv.os_unsetenv("WSYNC_PROGRAM")
    end
    assert.is_false(ok)
    assert.matches("WSYNC_PROGRAM=/nonexistent/wsync is not an executable file", err.message, 1, true)
  end)
end)
