-- wsync.recipe: loading in a restricted environment, validation errors that
-- name file, line and field, and command-line overrides.
local uv = require("luv")
local recipe = require("wsync.recipe")
local errors = require("wsync.errors")
local fixtures = require("tests.helpers.fixtures")

-- Runs fn and returns the wsync error object it raised.
local function error_of(fn, ...)
  local ok, err = pcall(fn, ...)
  assert.is_false(ok, "expected an error")
  assert.is_true(errors.is(err), "not a wsync error: " .. tostring(err))
  return err
end

local function fixture(name)
  for _, entry in ipairs(fixtures.broken) do
    if entry.file == name then
      return entry
    end
  end
  error("no fixture " .. name)
end

describe("recipe.load", function()
  it("loads a good recipe with its defaults filled", function()
    local path = fixtures.recipes .. "/good.lua"
    local loaded = recipe.load(path)
    assert.are.equal("fixture-good", loaded.name)
    assert.are.equal("host", loaded.backend)
    assert.are.equal(path, loaded.path)
    assert.are.same({ steps = 3, verbose = false, label = "fixture" }, loaded.params)
    assert.is_function(loaded.run)
  end)

  it("loads recipes/smoke.lua", function()
    local loaded = recipe.load("recipes/smoke.lua")
    assert.are.equal("smoke", loaded.name)
    assert.are.equal(2, loaded.params.ranks)
  end)

  for _, name in ipairs({ "sets_global.lua", "reads_undefined.lua", "requires_other.lua" }) do
    it("refuses what the restricted environment forbids: " .. name, function()
      local entry = fixture(name)
      local err = error_of(recipe.load, entry.path)
      assert.are.equal("RECIPE_INVALID", err.code)
      assert.are.equal(entry.path, err.file)
      assert.are.equal(entry.line, err.line)
      assert.matches("'" .. entry.subject .. "'", err.message, 1, true)
      assert.are.equal(entry.path .. ":" .. entry.line .. ": " .. err.message, tostring(err))
    end)
  end

  it("explains each restriction", function()
    assert.matches("sets the global 'counter': use a local", error_of(recipe.load, fixture("sets_global.lua").path).message, 1, true)
    assert.matches("reads the undefined global", error_of(recipe.load, fixture("reads_undefined.lua").path).message, 1, true)
    assert.matches("may only require wsync modules", error_of(recipe.load, fixture("requires_other.lua").path).message, 1, true)
  end)

  it("reports a syntax error with its line", function()
    local entry = fixture("syntax_error.lua")
    local err = error_of(recipe.load, entry.path)
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.are.equal(entry.line, err.line)
    assert.matches("^syntax error: ", err.message)
  end)

  it("reports an error raised while the recipe runs, with its line", function()
    local entry = fixture("runtime_error.lua")
    local err = error_of(recipe.load, entry.path)
    assert.are.equal(entry.line, err.line)
    assert.are.equal("steps are not computable", err.message)
  end)

  it("refuses a recipe that does not return a table, at its return line", function()
    local entry = fixture("returns_string.lua")
    local err = error_of(recipe.load, entry.path)
    assert.are.equal(entry.line, err.line)
    assert.are.equal("a recipe must return a table, got string", err.message)
  end)

  for _, name in ipairs({ "bad_backend.lua", "unknown_field.lua", "bad_param.lua", "bad_name.lua" }) do
    it("names file, line and field of a schema failure: " .. name, function()
      local entry = fixture(name)
      local err = error_of(recipe.load, entry.path)
      assert.are.equal("RECIPE_INVALID", err.code)
      assert.are.equal(entry.path, err.file)
      assert.are.equal(entry.subject, err.field)
      assert.are.equal(entry.line, err.line)
      assert.matches("field '" .. entry.subject .. "'", err.message, 1, true)
    end)
  end

  it("refuses a missing file", function()
    local err = error_of(recipe.load, "tests/fixtures/recipes/does_not_exist.lua")
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.matches("cannot open the recipe: ", err.message, 1, true)
    assert.matches("No such file", err.message, 1, true)
  end)

  describe("under a long path", function()
    local directory, path
    before_each(function()
      directory = assert(uv.fs_mkdtemp("/tmp/wsync-recipe-XXXXXX"))
      path = directory .. "/" .. string.rep("deeply_nested_recipe_directory_", 3) .. "syntax_error.lua"
      local source = assert(io.open(fixture("syntax_error.lua").path)):read("*a")
      local file = assert(io.open(path, "w"))
      file:write(source)
      file:close()
    end)
    after_each(function()
      os.remove(path)
      assert(uv.fs_rmdir(directory))
    end)

    -- Lua shortens chunk names longer than 60 bytes in its messages
    -- ("...tail.lua:5:"); the line must still be found.
    it("still finds the line of a syntax error", function()
      assert.is_true(#path > 60)
      local err = error_of(recipe.load, path)
      assert.are.equal(path, err.file)
      assert.are.equal(fixture("syntax_error.lua").line, err.line)
      assert.matches("^syntax error: ", err.message)
    end)
  end)
end)

describe("recipe.field_line", function()
  it("finds a nested field after its parent", function()
    local path = fixtures.recipes .. "/good.lua"
    assert.are.equal(8, recipe.field_line(path, "params.steps"))
    assert.are.equal(7, recipe.field_line(path, "params"))
    assert.are.equal(12, recipe.field_line(path, "run"))
  end)

  it("falls back to the last return line", function()
    assert.are.equal(4, recipe.field_line(fixtures.recipes .. "/good.lua", "not_written"))
  end)
end)

describe("recipe overrides", function()
  local function loaded()
    return recipe.load(fixtures.recipes .. "/good.lua")
  end

  it("parses key=value words, keeping '=' in values", function()
    assert.are.same({ steps = "5", label = "a=b", empty = "" },
      recipe.parse_overrides({ "steps=5", "label=a=b", "empty=" }))
  end)

  it("refuses words that are not key=value", function()
    for _, word in ipairs({ "steps", "=5", "5steps=1", "-x=1" }) do
      local err = error_of(recipe.parse_overrides, { word })
      assert.are.equal("USAGE", err.code)
      assert.matches("'" .. word .. "' is not a key=value parameter", err.message, 1, true)
    end
  end)

  it("converts values to the type of the default", function()
    local applied = recipe.apply_overrides(loaded(), { steps = "12", verbose = "true", label = "42" })
    assert.are.equal(12, applied.params.steps)
    assert.is_true(applied.params.verbose)
    assert.are.equal("42", applied.params.label)
    applied = recipe.apply_overrides(loaded(), { steps = "0x10", verbose = "false" })
    assert.are.equal(16, applied.params.steps)
    assert.is_false(applied.params.verbose)
  end)

  it("refuses an unknown key, listing the parameters", function()
    local err = error_of(recipe.apply_overrides, loaded(), { stpes = "1" })
    assert.are.equal("USAGE", err.code)
    assert.matches("has no parameter 'stpes' (parameters: label, steps, verbose)", err.message, 1, true)
  end)

  it("refuses values that do not convert", function()
    local err = error_of(recipe.apply_overrides, loaded(), { steps = "many" })
    assert.are.equal("USAGE", err.code)
    assert.are.equal("parameter 'steps' needs a number, got 'many'", err.message)
    err = error_of(recipe.apply_overrides, loaded(), { verbose = "yes" })
    assert.are.equal("parameter 'verbose' needs a boolean, got 'yes'", err.message)
  end)
end)
