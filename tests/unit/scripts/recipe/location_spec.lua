-- wsync.recipe.location: where a recipe's field is written, inherited or set
-- on the command line, and the RECIPE_INVALID errors that say so.
local uv = require("luv")
local location = require("wsync.recipe.location")
local fixtures = require("tests.helpers.fixtures")

local error_of = require("tests.helpers.errors").error_of

describe("field_line", function()
  it("finds a nested field after its parent", function()
    local path = fixtures.recipes .. "/good.lua"
    assert.are.equal(8, location.field_line(path, "params.steps"))
    assert.are.equal(7, location.field_line(path, "params"))
    assert.are.equal(12, location.field_line(path, "run"))
  end)

  it("falls back to the last return line", function()
    assert.are.equal(4, location.field_line(fixtures.recipes .. "/good.lua", "not_written"))
  end)
end)

-- A base recipe and one that extends it, written in a temporary directory.
local BASE = 'return {\n  name = "base",\n  model = { preset = "tiny" },\n  buffers = { bytes = 1024 },\n}\n'
local CHILD = '-- a child: extends(...) in a comment is no call\nreturn extends("base.lua", {\n  name = "child",\n'
  .. '  model = { preset = "tiny" },\n  trainer = { steps = 2 },\n})\n'

describe("the lines of a recipe that extends another", function()
  local directory, base, child
  before_each(function()
    directory = assert(uv.fs_mkdtemp("/tmp/wsync-location-XXXXXX"))
    base, child = directory .. "/base.lua", directory .. "/child.lua"
    for path, text in pairs({ [base] = BASE, [child] = CHILD }) do
      local file = assert(io.open(path, "w"))
      file:write(text)
      file:close()
    end
  end)
  after_each(function()
    assert(os.remove(base))
    assert(os.remove(child))
    assert(uv.fs_rmdir(directory))
  end)

  it("finds the extends call, not a comment that names it; the return line without one", function()
    assert.are.equal(2, location.extends_line(child))
    assert.are.equal(1, location.extends_line(base))
  end)

  it("reports a field where it is written, and an inherited one at the extends line naming the base's", function()
    local recipe = { path = child, files = { child, base } }
    assert.are.same({ 5 }, { location.field_location(recipe, "trainer.steps") })
    assert.are.same({ 2, base .. ":4" }, { location.field_location(recipe, "buffers.bytes") })
    assert.are.same({ 2 }, { location.field_location(recipe, "") }, "the whole recipe: its return line")
    assert.are.same({ 2 }, { location.field_location(recipe, "memory.kv_bytes") }, "written nowhere")
  end)

  it("names every file that gives a record, when more than one does", function()
    assert.are.equal(" (model is given in " .. child .. ":4 and " .. base .. ":3)",
      location.given_in({ child, base }, "model"))
    assert.are.equal("", location.given_in({ child, base }, "trainer"), "one file gives it")
    assert.are.equal("", location.given_in({ child, base }, "name"), "not a record")
    assert.are.equal("", location.given_in({ child, base }, ""))
  end)

  it("refuses a field at its line, an inherited one naming the base, one from the command line naming it",
    function()
      local recipe = { path = child, files = { child, base }, overrides = {} }
      local err = error_of(location.refuse, recipe, "trainer.steps", "too many")
      assert.are.same({ child, 5, "trainer.steps", "too many" }, { err.file, err.line, err.field, err.message })
      err = error_of(location.refuse, recipe, "buffers.bytes", "too small")
      assert.are.equal("RECIPE_INVALID", err.code)
      assert.are.same({ child, 2, "buffers.bytes" }, { err.file, err.line, err.field })
      assert.are.equal("too small (buffers.bytes is inherited from " .. base .. ":4)", err.message)
      recipe.overrides = { ["buffers.bytes"] = "1" }
      err = error_of(location.refuse, recipe, "buffers.bytes", "too small")
      assert.is_nil(err.line)
      assert.are.equal("too small (set on the command line: buffers.bytes=1)", err.message)
    end)
end)

describe("override_of", function()
  it("finds the KEY=VALUE that set a field, a field inside it, or the record it is in", function()
    local overrides = { ["trainer.steps"] = "0", schedule = "{}" }
    assert.are.equal("trainer.steps=0", location.override_of(overrides, "trainer.steps"))
    assert.are.equal("trainer.steps=0", location.override_of(overrides, "trainer"), "a record's check")
    assert.are.equal("schedule={}", location.override_of(overrides, "schedule[2]"))
    assert.is_nil(location.override_of(overrides, "trainer.ranks"))
    assert.is_nil(location.override_of(overrides, "trainer.steps_x"))
    assert.is_nil(location.override_of(nil, "trainer.steps"))
  end)
end)

describe("invalid", function()
  it("raises RECIPE_INVALID naming the file, and the line and field when given", function()
    local err = error_of(location.invalid, "x.lua", "it is wrong", { line = 3, field = "name" })
    assert.are.same({ "RECIPE_INVALID", "x.lua", 3, "name" }, { err.code, err.file, err.line, err.field })
    assert.are.equal("x.lua:3: it is wrong", tostring(err))
    assert.are.equal("x.lua: it is wrong", tostring(error_of(location.invalid, "x.lua", "it is wrong")))
  end)
end)
