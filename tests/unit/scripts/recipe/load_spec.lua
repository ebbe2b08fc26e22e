-- wsync.recipe.load: a recipe file run in its restricted environment,
-- extends, and the validation errors that name file, line and field.
local uv = require("luv")
local load_module = require("wsync.recipe.load")
local overrides_module = require("wsync.recipe.overrides")
local fixtures = require("tests.helpers.fixtures")

local error_of = require("tests.helpers.errors").error_of

local function fixture(name)
  for _, entry in ipairs(fixtures.broken) do
    if entry.file == name then
      return entry
    end
  end
  error("no fixture " .. name)
end

describe("environment", function()
  it("gives the safe globals, copies of math, string and table, and four functions of os", function()
    local env = load_module.environment("recipe.lua")
    assert.are.equal(pairs, env.pairs)
    assert.are.equal(math.floor, env.math.floor)
    env.math.floor, env.string.rep = nil, nil
    assert.is_function(math.floor, "a recipe changes its own copy")
    assert.is_function(string.rep)
    local names = {}
    for name in pairs(env.os) do
      names[#names + 1] = name
    end
    table.sort(names)
    assert.are.same({ "clock", "date", "getenv", "time" }, names)
  end)

  it("lets a recipe require wsync modules only", function()
    local env = load_module.environment("recipe.lua")
    assert.are.equal(require("wsync.errors"), env.require("wsync.errors"))
    local ok, message = pcall(env.require, "io")
    assert.is_false(ok)
    assert.matches("a recipe may only require wsync modules, not 'io'", message, 1, true)
  end)

  it("refuses new globals and reads of undefined ones, naming the recipe", function()
    local env = load_module.environment("recipe.lua")
    local ok, message = pcall(function()
      env.counter = 1
    end)
    assert.is_false(ok)
    assert.matches("recipe recipe.lua sets the global 'counter': use a local", message, 1, true)
    ok, message = pcall(function()
      return env.io
    end)
    assert.is_false(ok)
    assert.matches("recipe recipe.lua reads the undefined global 'io'", message, 1, true)
  end)
end)

describe("load", function()
  it("loads a good recipe with its defaults filled", function()
    local path = fixtures.recipes .. "/good.lua"
    local loaded = load_module.load(path)
    assert.are.equal("fixture-good", loaded.name)
    assert.are.equal("host", loaded.backend)
    assert.are.equal(path, loaded.path)
    assert.are.same({ steps = 3, verbose = false, label = "fixture" }, loaded.params)
    assert.is_function(loaded.run)
  end)

  it("takes the requests a session keeps streaming (rollout.stream), and refuses none or too many", function()
    local loaded = load_module.load("recipes/demo_async.lua")
    assert.are.same({ stream = 4, max_tokens = 65536 }, loaded.rollout)
    for _, stream in ipairs({ "0", "1025", "2.5" }) do
      local overrides = overrides_module.parse_overrides({ "rollout.stream=" .. stream })
      local err = error_of(load_module.load, "recipes/demo_async.lua", overrides)
      assert.are.equal("RECIPE_INVALID", err.code)
      assert.are.equal("rollout.stream", err.field, err.message)
    end
  end)

  it("loads recipes/smoke.lua", function()
    local loaded = load_module.load("recipes/smoke.lua")
    assert.are.equal("smoke", loaded.name)
    assert.are.equal(2, loaded.params.ranks)
  end)

  for _, name in ipairs({ "sets_global.lua", "reads_undefined.lua", "requires_other.lua" }) do
    it("refuses what the restricted environment forbids: " .. name, function()
      local entry = fixture(name)
      local err = error_of(load_module.load, entry.path)
      assert.are.equal("RECIPE_INVALID", err.code)
      assert.are.equal(entry.path, err.file)
      assert.are.equal(entry.line, err.line)
      assert.matches("'" .. entry.subject .. "'", err.message, 1, true)
      assert.are.equal(entry.path .. ":" .. entry.line .. ": " .. err.message, tostring(err))
    end)
  end

  it("explains each restriction", function()
    local function message_of(file)
      return error_of(load_module.load, fixture(file).path).message
    end
    assert.matches("sets the global 'counter': use a local", message_of("sets_global.lua"), 1, true)
    assert.matches("reads the undefined global", message_of("reads_undefined.lua"), 1, true)
    assert.matches("may only require wsync modules", message_of("requires_other.lua"), 1, true)
  end)

  it("reports a syntax error with its line", function()
    local entry = fixture("syntax_error.lua")
    local err = error_of(load_module.load, entry.path)
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.are.equal(entry.line, err.line)
    assert.matches("^syntax error: ", err.message)
  end)

  it("reports an error raised while the recipe runs, with its line", function()
    local entry = fixture("runtime_error.lua")
    local err = error_of(load_module.load, entry.path)
    assert.are.equal(entry.line, err.line)
    assert.are.equal("steps are not computable", err.message)
  end)

  it("refuses a recipe that does not return a table, at its return line", function()
    local entry = fixture("returns_string.lua")
    local err = error_of(load_module.load, entry.path)
    assert.are.equal(entry.line, err.line)
    assert.are.equal("a recipe must return a table, got string", err.message)
  end)

  for _, name in ipairs({ "bad_backend.lua", "unknown_field.lua", "bad_param.lua", "bad_name.lua" }) do
    it("names file, line and field of a schema failure: " .. name, function()
      local entry = fixture(name)
      local err = error_of(load_module.load, entry.path)
      assert.are.equal("RECIPE_INVALID", err.code)
      assert.are.equal(entry.path, err.file)
      assert.are.equal(entry.subject, err.field)
      assert.are.equal(entry.line, err.line)
      assert.matches("field '" .. entry.subject .. "'", err.message, 1, true)
    end)
  end

  it("refuses a missing file", function()
    local err = error_of(load_module.load, "tests/fixtures/recipes/does_not_exist.lua")
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.matches("cannot open the recipe: ", err.message, 1, true)
    assert.matches("No such file", err.message, 1, true)
    assert.is_nil(err.line)
    assert.are.equal("tests/fixtures/recipes/does_not_exist.lua: cannot open the recipe: No such file or directory",
      tostring(err))
  end)

  -- (Found with tests/fuzz: LuaJIT loads bytecode unchecked, and a
  -- damaged one crashed the host.)
  it("refuses a file of compiled Lua bytecode, valid or damaged", function()
    local directory = assert(uv.fs_mkdtemp("/tmp/wsync-recipe-XXXXXX"))
    local path = directory .. "/compiled.lua"
    local bytecode = string.dump(function()
      return { name = "compiled", run = function() end }
    end)
    for _, bytes in ipairs({ bytecode, bytecode:sub(1, 5) .. string.rep("\255", #bytecode - 5) }) do
      local file = assert(io.open(path, "wb"))
      file:write(bytes)
      file:close()
      local err = error_of(load_module.load, path)
      assert.are.equal("RECIPE_INVALID", err.code)
      assert.are.equal(path .. ": the file is compiled Lua bytecode; a recipe must be Lua source text", tostring(err))
    end
    os.remove(path)
    assert(uv.fs_rmdir(directory))
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
      local err = error_of(load_module.load, path)
      assert.are.equal(path, err.file)
      assert.are.equal(fixture("syntax_error.lua").line, err.line)
      assert.matches("^syntax error: ", err.message)
    end)
  end)
end)

describe("extends", function()
  local directory, written
  local function write(name, text)
    local path = directory .. "/" .. name
    local file = assert(io.open(path, "w"))
    file:write(text)
    file:close()
    written[#written + 1] = path
    return path
  end

  before_each(function()
    directory, written = assert(uv.fs_mkdtemp("/tmp/wsync-extends-XXXXXX")), {}
    assert(uv.fs_mkdir(directory .. "/sub", 448))
  end)
  after_each(function()
    for _, path in ipairs(written) do
      assert(os.remove(path))
    end
    assert(uv.fs_rmdir(directory .. "/sub"))
    assert(uv.fs_rmdir(directory))
  end)

  it("returns the base merged with the overrides, unvalidated, and records the base's file", function()
    local base = write("base.lua", 'return { name = "base", backend = "tpu", params = { a = 1, b = 2 } }\n')
    local path = directory .. "/child.lua"
    local loading = { files = { path }, stack = { path } }
    local merged = load_module.extend(path, "base.lua", { params = { b = 20 } }, loading)
    assert.are.same({ name = "base", backend = "tpu", params = { a = 1, b = 20 } }, merged)
    assert.are.same({ path, base }, loading.files)
    assert.are.same({ path }, loading.stack, "the base is off the stack once loaded")
  end)

  it("loads the base relative to the extending file and validates the merged recipe", function()
    write("base.lua", 'return { name = "base", params = { steps = 3, label = "x" }, run = function() end }\n')
    local path = write("sub/child.lua", 'return extends("../base.lua", { name = "child", params = { steps = 9 } })\n')
    local loaded = load_module.load(path)
    assert.are.equal("child", loaded.name)
    assert.are.same({ steps = 9, label = "x" }, loaded.params)
    assert.is_function(loaded.run)
    assert.are.same({ path, directory .. "/base.lua" }, loaded.files)
  end)

  it("extends a recipe that extends another", function()
    write("a.lua", 'return { name = "a", params = { one = 1, two = 2, three = 3 }, run = function() end }\n')
    write("b.lua", 'return extends("a.lua", { name = "b", params = { two = 20 } })\n')
    local loaded = load_module.load(write("c.lua",
      'return extends("b.lua", { name = "c", params = { three = 30 } })\n'))
    assert.are.same({ one = 1, two = 20, three = 30 }, loaded.params)
    assert.are.equal(3, #loaded.files)
  end)

  it("reports a field inherited from the base at the extends line, naming the base's line", function()
    write("base.lua", 'return {\n  name = "base",\n  backend = "tpu",\n  run = function() end,\n}\n')
    local path = write("child.lua", '-- a child\nreturn extends("base.lua", {\n  name = "child",\n})\n')
    local err = error_of(load_module.load, path)
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.are.equal(path, err.file)
    assert.are.equal(2, err.line)
    assert.are.equal("backend", err.field)
    assert.matches("(inherited from " .. directory .. "/base.lua:3)", err.message, 1, true)
  end)

  it("reports a field written in the extending file at its own line", function()
    write("base.lua", 'return { name = "base", run = function() end }\n')
    local path = write("child.lua", 'return extends("base.lua", {\n  name = "child",\n  backend = "tpu",\n})\n')
    local err = error_of(load_module.load, path)
    assert.are.equal(3, err.line)
    assert.is_nil(err.message:find("inherited", 1, true))
  end)

  it("names the base file and line of an error inside the base", function()
    local base = write("base.lua", 'return {\n  name = "base" +,\n}\n')
    local err = error_of(load_module.load, write("child.lua", 'return extends("base.lua", { name = "child" })\n'))
    assert.are.equal(base, err.file)
    assert.are.equal(2, err.line)
    assert.matches("^syntax error: ", err.message)
  end)

  it("refuses a missing base at the extends line", function()
    local path = write("child.lua", '-- extends(\nreturn extends("nothing.lua", { name = "child" })\n')
    local err = error_of(load_module.load, path)
    assert.are.equal(path, err.file)
    assert.are.equal(2, err.line)
    assert.matches("extends nothing.lua: cannot open " .. directory .. "/nothing.lua: No such file", err.message, 1,
      true)
  end)

  it("refuses a cycle, naming the file and line that closes it", function()
    write("a.lua", 'return extends("b.lua", {})\n')
    local b = write("b.lua", '\nreturn extends("a.lua", {})\n')
    local err = error_of(load_module.load, directory .. "/a.lua")
    assert.are.equal(b, err.file)
    assert.are.equal(2, err.line)
    assert.matches("extends a.lua, which is already being loaded (a cycle)", err.message, 1, true)
  end)

  it("refuses arguments of the wrong type", function()
    local err = error_of(load_module.load, write("child.lua", 'return extends({}, {})\n'))
    assert.matches("extends needs the path of a recipe file, got table", err.message, 1, true)
    err = error_of(load_module.load, write("child2.lua", 'return extends("x.lua", "name")\n'))
    assert.matches("extends takes a table of overrides, got string", err.message, 1, true)
  end)

  it("replaces the base's model preset by the extension's config, and the other way", function()
    write("preset.lua", 'return extends("' .. uv.cwd() .. '/recipes/demo.lua", { name = "p" })\n')
    local config = 'model = { config = { hidden_size = 64 } }'
    local switched = load_module.load(write("config.lua",
      'return extends("preset.lua", { name = "c", ' .. config .. ' })\n'))
    assert.is_nil(switched.model.preset)
    assert.are.same({ hidden_size = 64 }, switched.model.config)
    assert.are.equal("qwen3_moe", switched.model.family, "the rest of the record merges")
    local back = load_module.load(write("back.lua", 'return extends("config.lua", { model = { preset = "tiny" } })\n'))
    assert.are.equal("tiny", back.model.preset)
    assert.is_nil(back.model.config)
  end)

  it("names both files when the model is given both ways", function()
    local base = write("base.lua", 'return {\n  name = "base",\n  model = { preset = "tiny" },\n}\n')
    local path = write("child.lua", 'return extends("base.lua", {\n  model = { preset = "tiny", config = {} },\n})\n')
    local err = error_of(load_module.load, path)
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.are.equal(path, err.file)
    assert.are.equal(2, err.line)
    assert.matches("field 'model': give exactly one of preset and config (model is given in " .. path .. ":2 and "
      .. base .. ":3)", err.message, 1, true)
  end)

  it("lets the fixtures share the demo: the fault fixture is the demo with short timeouts", function()
    local demo = load_module.load("recipes/demo.lua")
    local faults = load_module.load(fixtures.recipes .. "/publish_faults.lua")
    assert.are.same(demo.schedule, faults.schedule)
    assert.are.same(demo.buffers, faults.buffers)
    assert.are.equal(2, faults.timeouts.load_chunk)
    assert.are.equal(300, faults.runtime.grace_ms)
    assert.are.equal(demo.runtime.tp, faults.runtime.tp)
  end)
end)
