-- wsync.errors: error objects, their text and their exit codes.
local errors = require("wsync.errors")

describe("errors.new and tostring", function()
  it("keeps code, message and extra fields", function()
    local err = errors.new("PUBLISH_FAILED", "chunk 3 did not load", { phase = "chunks", rank = 1, cause = "timeout" })
    assert.are.equal("PUBLISH_FAILED", err.code)
    assert.are.equal("chunk 3 did not load", err.message)
    assert.are.equal("timeout", err.cause)
    assert.is_true(errors.is(err))
  end)

  it("does not let extra fields replace code and message", function()
    local err = errors.new("A", "real", { code = "B", message = "fake" })
    assert.are.equal("A", err.code)
    assert.are.equal("real", err.message)
  end)

  it("formats the message alone", function()
    assert.are.equal("it broke", tostring(errors.new("X", "it broke")))
  end)

  it("formats file and line before the message", function()
    assert.are.equal("r.lua:7: bad", tostring(errors.new("X", "bad", { file = "r.lua", line = 7 })))
    assert.are.equal("r.lua: bad", tostring(errors.new("X", "bad", { file = "r.lua" })))
  end)

  it("formats phase and rank in brackets", function()
    assert.are.equal("[phase verify, rank 2] manifest differs",
      tostring(errors.new("X", "manifest differs", { phase = "verify", rank = 2 })))
    assert.are.equal("[rank 0] m", tostring(errors.new("X", "m", { rank = 0 })))
    assert.are.equal("f.lua:1: [phase start] m",
      tostring(errors.new("X", "m", { phase = "start", file = "f.lua", line = 1 })))
  end)
end)

describe("errors.raise and errors.is", function()
  it("raises the error object itself, without position", function()
    local ok, err = pcall(errors.raise, "USAGE", "wrong", { field = "x" })
    assert.is_false(ok)
    assert.is_true(errors.is(err))
    assert.are.equal("USAGE", err.code)
    assert.are.equal("x", err.field)
  end)

  it("tells error objects from other values", function()
    for _, value in ipairs({ "text", 1, {}, { code = "X", message = "m" }, true }) do
      assert.is_false(errors.is(value))
    end
    assert.is_false(errors.is(nil))
  end)
end)

describe("errors.exit_code", function()
  it("maps codes to the documented exit codes", function()
    assert.are.equal(2, errors.exit_code(errors.new("USAGE", "m")))
    assert.are.equal(3, errors.exit_code(errors.new("RECIPE_INVALID", "m")))
    assert.are.equal(3, errors.exit_code(errors.new("SCRIPT_INVALID", "m")))
    assert.are.equal(130, errors.exit_code(errors.new("INTERRUPTED", "m")))
    assert.are.equal(1, errors.exit_code(errors.new("LUA_ERROR", "m")))
    assert.are.equal(1, errors.exit_code(errors.new("ANYTHING_ELSE", "m")))
  end)

  it("maps plain values: 'interrupted' to 130, the rest to 1", function()
    assert.are.equal(130, errors.exit_code("interrupted"))
    assert.are.equal(130, errors.exit_code("interrupted\nstack traceback: ..."))
    assert.are.equal(1, errors.exit_code("x.lua:1: interrupted"))
    assert.are.equal(1, errors.exit_code("boom"))
    assert.are.equal(1, errors.exit_code({}))
    assert.are.equal(1, errors.exit_code(nil))
  end)
end)

describe("errors.format", function()
  local err = errors.new("X", "failed", { traceback = "stack traceback:\n\tsomewhere" })

  it("adds the traceback only when verbose", function()
    assert.are.equal("failed", errors.format(err, false))
    assert.are.equal("failed\nstack traceback:\n\tsomewhere", errors.format(err, true))
  end)

  it("formats strings as they are", function()
    assert.are.equal("plain", errors.format("plain", true))
  end)
end)
