-- wsync.util.json: the same text for the same value (sorted keys).
-- wsync.util.append_unseen: distinct values in the order they first came.
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

describe("wsync.util.json", function()
  local cjson = require("cjson")

  it("sorts every object's keys, at every depth", function()
    assert.are.equal('{"a":{"x":1,"y":2},"b":[{"c":3,"d":4}],"z":true}',
      util.json({ z = true, b = { { d = 4, c = 3 } }, a = { y = 2, x = 1 } }))
  end)

  it("gives the same text for tables built in different orders", function()
    local first, second = {}, {}
    for i = 1, 50 do
      first["key" .. i] = i
    end
    for i = 50, 1, -1 do
      second["key" .. i] = i
    end
    assert.are.equal(util.json(first), util.json(second))
  end)

  it("writes null slots, empty arrays, integers and fractions", function()
    assert.are.equal('{"big":1e+300,"bytes":null,"empty":{},"list":[],"n":405248,"s":0.0123}',
      util.json({ bytes = util.json_null, empty = {}, list = util.json_array({}), n = 405248, s = 0.0123,
        big = 1e300 }))
  end)

  it("escapes what JSON needs escaped, and lua-cjson reads it back", function()
    local text = 'quote " backslash \\ newline \n tab \t bell \a'
    local encoded = util.json({ text = text })
    assert.are.equal(text, cjson.decode(encoded).text)
    assert.is_nil(encoded:find("\n", 1, true))
  end)

  it("refuses what JSON cannot hold", function()
    assert.has_error(function()
      util.json({ value = 0 / 0 })
    end, "json: cannot encode nan")
    assert.has_error(function()
      util.json({ [true] = 1 })
    end)
    assert.has_error(function()
      util.json({ print })
    end, "json: cannot encode a function")
  end)
end)

describe("wsync.util.append_unseen", function()
  it("keeps each value once, in the order it first came", function()
    local list, seen = {}, {}
    for _, value in ipairs({ "b", "a", "b", 3, "a", 3, "c" }) do
      util.append_unseen(list, seen, value)
    end
    assert.are.same({ "b", "a", 3, "c" }, list)
    assert.are.same({ a = true, b = true, c = true, [3] = true }, seen)
  end)

  it("skips what `seen` already holds", function()
    local list = { "x" }
    util.append_unseen(list, { y = true }, "y")
    assert.are.same({ "x" }, list)
  end)
end)
