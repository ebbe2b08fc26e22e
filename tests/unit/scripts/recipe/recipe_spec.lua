-- wsync.recipe: loading in a restricted environment, validation errors that
-- name file, line and field, and command-line overrides.
local uv = require("luv")
local recipe = require("wsync.recipe")
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

  it("takes the requests a session keeps streaming (rollout.stream), and refuses none or too many", function()
    local loaded = recipe.load("recipes/demo_async.lua")
    assert.are.same({ stream = 4, max_tokens = 65536 }, loaded.rollout)
    for _, stream in ipairs({ "0", "1025", "2.5" }) do
      local overrides = recipe.parse_overrides({ "rollout.stream=" .. stream })
      local err = error_of(recipe.load, "recipes/demo_async.lua", overrides)
      assert.are.equal("RECIPE_INVALID", err.code)
      assert.are.equal("rollout.stream", err.field, err.message)
    end
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
    local function message_of(file)
      return error_of(recipe.load, fixture(file).path).message
    end
    assert.matches("sets the global 'counter': use a local", message_of("sets_global.lua"), 1, true)
    assert.matches("reads the undefined global", message_of("reads_undefined.lua"), 1, true)
    assert.matches("may only require wsync modules", message_of("requires_other.lua"), 1, true)
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
      local err = error_of(recipe.load, path)
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

describe("recipe extends", function()
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

  it("merges records field by field and replaces lists and scalars", function()
    assert.are.same({ a = { x = 1, y = 20, z = { p = 1, q = 2 } }, list = { "c" }, n = 2, keep = true },
      recipe.merge({ a = { x = 1, y = 2, z = { p = 1 } }, list = { "a", "b" }, n = 1, keep = true },
        { a = { y = 20, z = { q = 2 } }, list = { "c" }, n = 2 }))
    local base = { t = { x = 1 } }
    recipe.merge(base, { t = { x = 2 } })
    assert.are.same({ t = { x = 1 } }, base, "the base is not changed")
    assert.are.same({ list = {} }, recipe.merge({ list = { 1 } }, { list = {} }), "an empty table replaces")
  end)

  it("loads the base relative to the extending file and validates the merged recipe", function()
    write("base.lua", 'return { name = "base", params = { steps = 3, label = "x" }, run = function() end }\n')
    local path = write("sub/child.lua", 'return extends("../base.lua", { name = "child", params = { steps = 9 } })\n')
    local loaded = recipe.load(path)
    assert.are.equal("child", loaded.name)
    assert.are.same({ steps = 9, label = "x" }, loaded.params)
    assert.is_function(loaded.run)
    assert.are.same({ path, directory .. "/base.lua" }, loaded.files)
  end)

  it("extends a recipe that extends another", function()
    write("a.lua", 'return { name = "a", params = { one = 1, two = 2, three = 3 }, run = function() end }\n')
    write("b.lua", 'return extends("a.lua", { name = "b", params = { two = 20 } })\n')
    local loaded = recipe.load(write("c.lua", 'return extends("b.lua", { name = "c", params = { three = 30 } })\n'))
    assert.are.same({ one = 1, two = 20, three = 30 }, loaded.params)
    assert.are.equal(3, #loaded.files)
  end)

  it("reports a field inherited from the base at the extends line, naming the base's line", function()
    write("base.lua", 'return {\n  name = "base",\n  backend = "tpu",\n  run = function() end,\n}\n')
    local path = write("child.lua", '-- a child\nreturn extends("base.lua", {\n  name = "child",\n})\n')
    local err = error_of(recipe.load, path)
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.are.equal(path, err.file)
    assert.are.equal(2, err.line)
    assert.are.equal("backend", err.field)
    assert.matches("(inherited from " .. directory .. "/base.lua:3)", err.message, 1, true)
  end)

  it("reports a field written in the extending file at its own line", function()
    write("base.lua", 'return { name = "base", run = function() end }\n')
    local path = write("child.lua", 'return extends("base.lua", {\n  name = "child",\n  backend = "tpu",\n})\n')
    local err = error_of(recipe.load, path)
    assert.are.equal(3, err.line)
    assert.is_nil(err.message:find("inherited", 1, true))
  end)

  it("names the base file and line of an error inside the base", function()
    local base = write("base.lua", 'return {\n  name = "base" +,\n}\n')
    local err = error_of(recipe.load, write("child.lua", 'return extends("base.lua", { name = "child" })\n'))
    assert.are.equal(base, err.file)
    assert.are.equal(2, err.line)
    assert.matches("^syntax error: ", err.message)
  end)

  it("refuses a missing base at the extends line", function()
    local path = write("child.lua", '-- extends(\nreturn extends("nothing.lua", { name = "child" })\n')
    local err = error_of(recipe.load, path)
    assert.are.equal(path, err.file)
    assert.are.equal(2, err.line)
    assert.matches("extends nothing.lua: cannot open " .. directory .. "/nothing.lua: No such file", err.message, 1,
      true)
  end)

  it("refuses a cycle, naming the file and line that closes it", function()
    write("a.lua", 'return extends("b.lua", {})\n')
    local b = write("b.lua", '\nreturn extends("a.lua", {})\n')
    local err = error_of(recipe.load, directory .. "/a.lua")
    assert.are.equal(b, err.file)
    assert.are.equal(2, err.line)
    assert.matches("extends a.lua, which is already being loaded (a cycle)", err.message, 1, true)
  end)

  it("refuses arguments of the wrong type", function()
    local err = error_of(recipe.load, write("child.lua", 'return extends({}, {})\n'))
    assert.matches("extends needs the path of a recipe file, got table", err.message, 1, true)
    err = error_of(recipe.load, write("child2.lua", 'return extends("x.lua", "name")\n'))
    assert.matches("extends takes a table of overrides, got string", err.message, 1, true)
  end)

  it("replaces the base's model preset by the extension's config, and the other way", function()
    write("preset.lua", 'return extends("' .. uv.cwd() .. '/recipes/demo.lua", { name = "p" })\n')
    local config = 'model = { config = { hidden_size = 64 } }'
    local switched = recipe.load(write("config.lua",
      'return extends("preset.lua", { name = "c", ' .. config .. ' })\n'))
    assert.is_nil(switched.model.preset)
    assert.are.same({ hidden_size = 64 }, switched.model.config)
    assert.are.equal("qwen3_moe", switched.model.family, "the rest of the record merges")
    local back = recipe.load(write("back.lua", 'return extends("config.lua", { model = { preset = "tiny" } })\n'))
    assert.are.equal("tiny", back.model.preset)
    assert.is_nil(back.model.config)
  end)

  it("names both files when the model is given both ways", function()
    local base = write("base.lua", 'return {\n  name = "base",\n  model = { preset = "tiny" },\n}\n')
    local path = write("child.lua", 'return extends("base.lua", {\n  model = { preset = "tiny", config = {} },\n})\n')
    local err = error_of(recipe.load, path)
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.are.equal(path, err.file)
    assert.are.equal(2, err.line)
    assert.matches("field 'model': give exactly one of preset and config (model is given in " .. path .. ":2 and "
      .. base .. ":3)", err.message, 1, true)
  end)

  it("lets the fixtures share the demo: the fault fixture is the demo with short timeouts", function()
    local demo = recipe.load("recipes/demo.lua")
    local faults = recipe.load(fixtures.recipes .. "/publish_faults.lua")
    assert.are.same(demo.schedule, faults.schedule)
    assert.are.same(demo.buffers, faults.buffers)
    assert.are.equal(2, faults.timeouts.load_chunk)
    assert.are.equal(300, faults.runtime.grace_ms)
    assert.are.equal(demo.runtime.tp, faults.runtime.tp)
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

describe("recipe field overrides", function()
  it("sets any field by its dotted path, reading each value as its field takes it", function()
    local loaded = recipe.load("recipes/demo.lua", { ["trainer.steps"] = "5", ["buffers.bytes"] = "1048576",
      ["runtime.respawn"] = "true", ["verify"] = "values", ["timeouts.fill"] = "2.5", ["name"] = "renamed",
      ["control.tcp"] = "127.0.0.1:0" })
    assert.are.equal(5, loaded.trainer.steps)
    assert.are.equal(1048576, loaded.buffers.bytes)
    assert.are.equal(2, loaded.buffers.count, "the rest of the record stays")
    assert.is_true(loaded.runtime.respawn)
    assert.are.equal("values", loaded.verify)
    assert.are.equal(2.5, loaded.timeouts.fill)
    assert.are.equal(30, loaded.timeouts.load_chunk)
    assert.are.equal("renamed", loaded.name)
    assert.are.equal("127.0.0.1:0", loaded.control.tcp)
    assert.is_false(recipe.load("recipes/demo.lua", { verify = "false" }).verify)
  end)

  it("reads tables as Lua, and a field of any type as what its text reads as", function()
    local loaded = recipe.load("recipes/demo.lua", { schedule = '{ { wake = { "weights" } }, "publish" }',
      ["model.config"] = "{ hidden_size = 64 }" })
    assert.are.same({ { wake = { "weights" } }, "publish" }, loaded.schedule)
    assert.are.same({ hidden_size = 64 }, loaded.model.config)
    assert.is_nil(loaded.model.preset, "a config replaces the preset")
    loaded = recipe.load("recipes/demo.lua", { ["model.config.hidden_size"] = "64",
      ["model.config.tie_word_embeddings"] = "false", ["model.config.model_type"] = "qwen3_moe" })
    assert.are.same({ hidden_size = 64, tie_word_embeddings = false, model_type = "qwen3_moe" }, loaded.model.config)
    assert.is_nil(loaded.model.preset)
    local back = recipe.load(fixtures.recipes .. "/vllm_tiny_cuda.lua", { ["model.preset"] = "tiny" })
    assert.are.equal("tiny", back.model.preset)
  end)

  it("still takes the parameters by name, or as params.NAME", function()
    local loaded = recipe.load(fixtures.recipes .. "/good.lua", { steps = "12", ["params.verbose"] = "true" })
    assert.are.same({ steps = 12, verbose = true, label = "fixture" }, loaded.params)
    local err = error_of(recipe.load, fixtures.recipes .. "/good.lua", { ["params.nope"] = "1" })
    assert.are.equal("USAGE", err.code)
    assert.matches("has no parameter 'nope' (parameters: label, steps, verbose)", err.message, 1, true)
  end)

  it("refuses an unknown field, naming the fields there are", function()
    local err = error_of(recipe.load, "recipes/demo.lua", { ["trainer.stpes"] = "5" })
    assert.are.equal("USAGE", err.code)
    assert.are.equal("recipe recipes/demo.lua has no field 'trainer.stpes' (trainer's fields: kind, ranks, steps, "
      .. "storage)", err.message)
    err = error_of(recipe.load, "recipes/demo.lua", { colour = "blue" })
    assert.are.equal("USAGE", err.code)
    assert.matches("has no parameter or field 'colour' (parameters: none; fields: backend, bootstrap, ",
      err.message, 1, true)
    err = error_of(recipe.load, "recipes/demo.lua", { ["trainer.steps.x"] = "1" })
    assert.are.equal("recipe recipes/demo.lua has no field 'trainer.steps.x': trainer.steps is not a table of fields",
      err.message)
  end)

  it("refuses a value that does not read as its field's type", function()
    for key, text in pairs({ ["trainer.steps"] = "many", ["runtime.respawn"] = "yes", verify = "maybe",
      schedule = "publish", ["model.config"] = "{ x = }" }) do
      local err = error_of(recipe.load, "recipes/demo.lua", { [key] = text })
      assert.are.equal("USAGE", err.code, key)
      assert.matches("^" .. key:gsub("%p", "%%%0") .. " takes ", err.message)
    end
    local err = error_of(recipe.load, fixtures.recipes .. "/good.lua", { run = "x" })
    assert.are.equal("run is a function: it cannot be given on the command line", err.message)
  end)

  it("names the command line when the recipe refuses an overridden field", function()
    local err = error_of(recipe.load, "recipes/demo.lua", { ["trainer.steps"] = "0" })
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.are.equal("trainer.steps", err.field)
    assert.is_nil(err.line)
    assert.are.equal("field 'trainer.steps': must be at least 1, got 0 (set on the command line: trainer.steps=0)",
      err.message)
    err = error_of(recipe.check, recipe.load("recipes/demo.lua", { ["buffers.bytes"] = "1" }))
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.is_nil(err.line)
    assert.matches("raise buffers.bytes (set on the command line: buffers.bytes=1)", err.message, 1, true)
  end)
end)

-- A model recipe as a table (recipes/demo.lua's shape), with `changes` laid
-- over it (recipe.merge).
local function model_recipe(changes)
  return recipe.merge({
    name = "model",
    backend = "host",
    model = { family = "qwen3_moe", preset = "tiny" },
    trainer = { kind = "synthetic", ranks = 2, steps = 3 },
    runtime = { kind = "reference", tp = 2 },
    buffers = { bytes = 160 * 1024, count = 2 },
    memory = { device_bytes = 64 * 1024 * 1024, kv_bytes = 1024 * 1024 },
    schedule = { { wake = { "weights" } }, "publish" },
    timeouts = { load_chunk = 30 },
  }, changes or {})
end

local schema = require("wsync.recipe.schema")

-- The schema failure of a model recipe with `changes`, asserting there is one.
local function refused(changes)
  local result, failure = schema.check(recipe.schema, model_recipe(changes))
  assert.is_nil(result)
  return failure
end

describe("recipe schema numbers", function()
  -- Every number that reaches a byte count, a process count, a version or a
  -- timer: huge values are refused at validation, naming the value as the
  -- recipe wrote it (not as an int64 conversion prints it).
  local FIELDS = {
    { path = "buffers.bytes", set = function(v) return { buffers = { bytes = v } } end },
    { path = "buffers.count", set = function(v) return { buffers = { count = v } } end },
    { path = "trainer.ranks", set = function(v) return { trainer = { ranks = v } } end },
    { path = "trainer.steps", set = function(v) return { trainer = { steps = v } } end },
    { path = "runtime.tp", set = function(v) return { runtime = { tp = v } } end },
    { path = "runtime.grace_ms", set = function(v) return { runtime = { grace_ms = v } } end },
    { path = "memory.device_bytes", set = function(v) return { memory = { device_bytes = v } } end },
    { path = "memory.kv_bytes", set = function(v) return { memory = { kv_bytes = v } } end },
    { path = "memory.headroom_bytes", set = function(v) return { memory = { headroom_bytes = v } } end },
    { path = "memory.optimizer_factor", set = function(v) return { memory = { optimizer_factor = v } } end },
    { path = "timeouts.load_chunk", set = function(v) return { timeouts = { load_chunk = v } } end },
    { path = "timeouts.startup", set = function(v) return { timeouts = { startup = v } } end },
  }
  for _, field in ipairs(FIELDS) do
    for _, value in ipairs({ 1e308, 2 ^ 63, 2 ^ 53 + 2 }) do
      it("refuses " .. field.path .. " = " .. tostring(value) .. ", naming it as written", function()
        local failure = refused(field.set(value))
        assert.are.equal(field.path, failure.path)
        assert.matches(", got " .. tostring(value):gsub("%p", "%%%0") .. "$", failure.message)
        assert.is_nil(failure.message:find("9223372036854775808", 1, true))
      end)
    end
  end

  it("says what bounds each number and why", function()
    assert.are.equal("must be at most 9007199254740992 (2^53, the largest integer a Lua number holds exactly), "
      .. "got 1e+308", refused({ buffers = { bytes = 1e308 } }).message)
    assert.are.equal("must be at most 604800 (a week), got 1e+300", refused({ timeouts = { startup = 1e300 } }).message)
    assert.are.equal("must be at most 64 (64 times the parameters' bytes), got 1000",
      refused({ memory = { optimizer_factor = 1000 } }).message)
  end)

  it("needs buffers.bytes unless the path is direct (no packed buffers)", function()
    local given = model_recipe()
    given.buffers = { count = 2 }
    local _, failure = schema.check(recipe.schema, given)
    assert.are.equal("buffers", failure.path)
    assert.are.equal("give bytes, the size of each packed buffer (or direct = true: none)", failure.message)
    given.buffers, given.backend, given.trainer.ranks, given.runtime.tp = { direct = true }, "cuda", 1, 1
    local checked, refusal = schema.check(recipe.schema, given)
    assert.is_table(checked, refusal and refusal.message)
  end)

  it("accepts the bounds themselves", function()
    assert.is_table(schema.check(recipe.schema, model_recipe({ memory = { device_bytes = 2 ^ 53,
      headroom_bytes = 2 ^ 50 }, timeouts = { startup = recipe.MAX_SECONDS }, trainer = { steps = 2 ^ 53 } })))
  end)

  it("refuses more trainer ranks than the host backend has devices, and than one node holds", function()
    local devices = require("wsync.native.device").count("host")
    assert.is_table(schema.check(recipe.schema, model_recipe({ trainer = { ranks = devices },
      runtime = { tp = devices } })))
    local failure = refused({ trainer = { ranks = 100000 }, runtime = { tp = 100000 } })
    assert.are.equal("trainer.ranks", failure.path)
    assert.are.equal(string.format("100000 trainer ranks: the host backend has %d devices, one per trainer rank and "
      .. "its TP worker", devices), failure.message)
    -- cuda: a static bound (check does not query the GPU)
    assert.is_table(schema.check(recipe.schema, model_recipe({ backend = "cuda", trainer = { ranks = 128 },
      runtime = { tp = 128 } })))
    failure = refused({ backend = "cuda", trainer = { ranks = 100000 }, runtime = { tp = 100000 } })
    assert.are.equal("trainer.ranks", failure.path)
    assert.matches("^100000 trainer ranks: at most 1024 on one node", failure.message)
  end)

  it("refuses a TP size other than the trainer world, which the preflight would refuse after the start", function()
    local failure = refused({ runtime = { tp = 1 } })
    assert.are.equal("runtime.tp", failure.path)
    assert.are.equal("TP 1 differs from the 2 trainer ranks: TP worker r runs on trainer rank r's device, so "
      .. "runtime.tp must equal trainer.ranks", failure.message)
  end)
end)

describe("recipe buffers.order", function()
  it("is auto unless given: gates on the cuda backend's packed buffers, required with device", function()
    local prepare = require("wsync.recipe.prepare").prepare
    local host = assert(schema.check(recipe.schema, model_recipe()))
    assert.are.equal("auto", host.buffers.order)
    assert.is_nil(prepare(host, { plan_only = true }).gated)
    local auto = assert(schema.check(recipe.schema, model_recipe({ backend = "cuda" })))
    local plan = prepare(auto, { plan_only = true })
    assert.is_true(plan.gated)
    assert.is_nil(plan.ordered)
    local device = assert(schema.check(recipe.schema, model_recipe({ backend = "cuda",
      buffers = { order = "device" } })))
    plan = prepare(device, { plan_only = true })
    assert.is_true(plan.gated and plan.ordered)
    local unordered = assert(schema.check(recipe.schema, model_recipe({ backend = "cuda",
      buffers = { order = "host" } })))
    assert.is_nil(prepare(unordered, { plan_only = true }).gated)
    local direct = assert(schema.check(recipe.schema, model_recipe({ backend = "cuda", trainer = { ranks = 1 },
      runtime = { tp = 1 }, buffers = { direct = true } })))
    assert.is_nil(prepare(direct, { plan_only = true }).gated)
  end)

  it("refuses device on the host backend, on the direct path, and another value", function()
    local failure = refused({ buffers = { order = "device" } })
    assert.are.equal("buffers.order", failure.path)
    assert.are.equal("chunks ordered on the device need the cuda backend's packed buffers (here host)",
      failure.message)
    failure = refused({ backend = "cuda", trainer = { ranks = 1 }, runtime = { tp = 1 },
      buffers = { order = "device", direct = true } })
    assert.are.equal("buffers.order", failure.path)
    assert.matches("(here cuda, the direct path)", failure.message, 1, true)
    failure = refused({ buffers = { order = "gpu" } })
    assert.are.equal("buffers.order", failure.path)
    assert.matches("expected one of auto, host, device", failure.message, 1, true)
  end)
end)

describe("recipe verify", function()
  it("takes false, true, \"synthetic\" and \"values\" and says which check each makes", function()
    for value, mode in pairs({ [false] = false, [true] = "synthetic", synthetic = "synthetic", values = "values" }) do
      local checked = assert(schema.check(recipe.schema, model_recipe({ verify = value })))
      assert.are.equal(mode, recipe.verify_mode(checked))
    end
    assert.are.equal(false, recipe.verify_mode(assert(schema.check(recipe.schema, model_recipe()))))
  end)

  it("refuses another value", function()
    local failure = refused({ verify = "yes" })
    assert.are.equal("verify", failure.path)
    assert.matches("expected one of false, true, synthetic, values", failure.message, 1, true)
  end)
end)

describe("recipe.unserved", function()
  local function validated(changes)
    return assert(schema.check(recipe.schema, model_recipe(changes)))
  end

  it("serves the reference runtime on the host backend", function()
    assert.is_nil(recipe.unserved(validated()))
  end)

  it("names runtime.kind and what this build has for the runtimes it lacks", function()
    local message, field = recipe.unserved(validated({ runtime = { kind = "transformers" } }))
    assert.are.equal("runtime.kind", field)
    local backends = require("wsync").cuda_built and "cuda and host" or "host"
    assert.are.equal("runtime.kind 'transformers' is not in this build (this build has: reference, on the "
      .. backends .. " backend; vllm, on the " .. backends .. " backend)", message)
  end)

  it("refuses the vllm runtime on the host backend without an engine in place of vLLM", function()
    local unavailable = require("wsync.runtime.vllm").unavailable
    local validated_recipe = validated({ runtime = { kind = "vllm", model = "tests/fixtures/models/tiny" } })
    local saved = os.getenv
    os.getenv = function(name) -- luacheck: ignore 122 (this process's view of the variable)
      if name == "WSYNC_VLLM_ENGINE" then
        return nil
      end
      return saved(name)
    end
    local ok, message, field = pcall(unavailable, validated_recipe)
    os.getenv = saved -- luacheck: ignore 122
    assert.is_true(ok, message)
    assert.are.equal("backend", field)
    assert.matches("^backend 'host': vLLM runs on the cuda backend", message)
  end)

  it("names the backend that the reference runtime's workers cannot hold weights on in this build", function()
    local message, field = recipe.unserved(validated({ backend = "cuda" }))
    if require("wsync").cuda_built then
      -- (Built with cuda: refused here only when this machine has no GPU.)
      local count = require("wsync.native.device").count("cuda")
      if count and count > 0 then
        assert.is_nil(message)
      else
        assert.are.equal("backend", field)
        assert.matches("^backend 'cuda': this machine has no usable GPU", message)
      end
      return
    end
    assert.are.equal("backend", field)
    assert.are.equal("backend 'cuda': this build's reference runtime holds weights on the host backend only", message)
  end)

  it("says plainly why the cuda backend cannot run here, CUDA's own words after", function()
    local build = require("wsync").build
    local cuda, toolkit = build.cuda, build.cuda_toolkit
    build.cuda, build.cuda_toolkit = true, "13.0.88"
    local reasons = {
      recipe.no_gpu("cuda backend: cudaGetDeviceCount: cudaErrorInsufficientDriver (CUDA driver version is "
        .. "insufficient for CUDA runtime version)"),
      recipe.no_gpu("cuda backend: cudaGetDeviceCount: cudaErrorNoDevice (no CUDA-capable device is detected)"),
      recipe.no_gpu(nil),
    }
    build.cuda = false
    reasons[4] = recipe.no_gpu("nccl: this wsync was built without CUDA")
    build.cuda, build.cuda_toolkit = cuda, toolkit
    assert.are.same({
      "backend 'cuda': this machine has no usable GPU: no NVIDIA driver is loaded, or one too old for the CUDA "
        .. "13.0.88 runtime this wsync was built with (CUDA says cudaErrorInsufficientDriver)",
      "backend 'cuda': this machine has no usable GPU: the NVIDIA driver sees no GPU (CUDA_VISIBLE_DEVICES may hide "
        .. "them) (CUDA says cudaErrorNoDevice)",
      "backend 'cuda': this machine has no usable GPU (the CUDA runtime sees 0 devices)",
      "backend 'cuda': this wsync was built without CUDA (no CUDA toolkit when it was built): it runs the host "
        .. "backend only",
    }, reasons)
  end)

  it("refuses the cuda backend where no CUDA device is usable, naming the backend", function()
    local count = require("wsync.native.device").count("cuda")
    if count and count > 0 then
      pending("this machine has a CUDA device")
      return
    end
    local err = error_of(recipe.check, recipe.load(fixtures.recipes .. "/backend_cuda.lua"))
    assert.are.equal("backend", err.field)
    assert.matches("^backend 'cuda': ", err.message)
  end)

  it("names a generate step of a runtime that does not generate", function()
    local schedule = { { wake = { "weights" } }, "publish", { wake = { "kv_cache" } }, "generate" }
    assert.is_nil(recipe.unserved(validated({ schedule = schedule })), "the reference runtime's toy decoder serves it")
    local saved = recipe.RUNTIMES.reference.generates
    recipe.RUNTIMES.reference.generates = false
    local message, field = recipe.unserved(validated({ schedule = schedule }))
    recipe.RUNTIMES.reference.generates = saved
    assert.are.equal("schedule[4]", field)
    assert.are.equal("schedule[4] (generate): the reference runtime does not generate text", message)
  end)
end)

describe("recipe.check", function()
  local function loaded(path)
    return recipe.load(path)
  end

  it("refuses a recipe with nothing to run at its return line", function()
    local path = fixtures.recipes .. "/no_model.lua"
    local err = error_of(recipe.check, loaded(path))
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.are.equal(path, err.file)
    assert.are.equal(fixtures.bad_line(path), err.line)
    assert.are.equal("the recipe has nothing to run: it defines neither `run` nor `model`", err.message)
  end)

  it("passes a run recipe without a plan and returns a model recipe's plan", function()
    assert.is_nil(recipe.check(loaded(fixtures.recipes .. "/good.lua")))
    local plan, topology, memory = recipe.check(loaded("recipes/demo.lua"))
    assert.are.equal(3, #plan.chunks)
    assert.are.same({ world = 2, tp = 2, replicas = 1 }, topology)
    assert.is_number(memory.peak)
  end)

  it("refuses a runtime this build lacks, naming runtime.kind at its line", function()
    local path = fixtures.recipes .. "/runtime_transformers.lua"
    local err = error_of(recipe.check, loaded(path))
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.are.equal("runtime.kind", err.field)
    assert.are.equal(fixtures.bad_line(path), err.line)
  end)

  it("refuses a vllm runtime without its model directory, naming runtime.model at its line", function()
    local path = fixtures.recipes .. "/runtime_vllm.lua"
    local err = error_of(recipe.load, path)
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.are.equal("runtime.model", err.field)
    assert.are.equal(fixtures.bad_line(path), err.line)
  end)

  it("refuses vllm runtime fields on another runtime, naming the field", function()
    local failure = refused({ runtime = { kind = "reference", load = "native" } })
    assert.are.same({ path = "runtime.load", message = "is for the vllm runtime; this recipe's runtime is reference" },
      failure)
  end)

  it("with plan_only checks the plan of a recipe this build cannot serve", function()
    local plan = recipe.check(loaded(fixtures.recipes .. "/backend_cuda.lua"), { plan_only = true })
    assert.are.equal(3, #plan.chunks)
    local err = error_of(recipe.check, loaded(fixtures.recipes .. "/backend_cuda.lua"))
    assert.are.equal("backend", err.field)
  end)
end)

describe("recipe control", function()
  local ffi = require("ffi")
  pcall(ffi.cdef, "int setenv(const char *, const char *, int); int unsetenv(const char *);")
  local TOKEN = "0123456789abcdef0123456789abcdef"

  it("takes a socket path, and a TCP endpoint's token from the environment or a file", function()
    assert.is_table(schema.check(recipe.schema, model_recipe({ control = { endpoint = "/tmp/wsync.sock" } })))
    assert.is_table(schema.check(recipe.schema, model_recipe({ control = { tcp = "127.0.0.1:0", token_env = "T" } })))
    assert.is_table(schema.check(recipe.schema, model_recipe({ control = { tcp = "127.0.0.1:0",
      token_file = "token" } })))
  end)

  it("refuses a token without TCP, and a token given in two places", function()
    local failure = refused({ control = { token_env = "T" } })
    assert.are.equal("control.token_env", failure.path)
    assert.matches("gives the token of the TCP endpoint; this recipe has no control.tcp", failure.message, 1, true)
    failure = refused({ control = { tcp = "127.0.0.1:0", token_env = "T", token_file = "f" } })
    assert.are.equal("control.token_file", failure.path)
    assert.are.equal("give the token in one place: token_env or token_file", failure.message)
  end)

  it("reads the token from the variable or the file, and refuses one that is missing or too short", function()
    local function with(control)
      return assert(schema.check(recipe.schema, model_recipe({ control = control })))
    end
    assert.is_nil((recipe.control_token(with({ tcp = "127.0.0.1:0" }))))
    ffi.C.setenv("WSYNC_SPEC_TOKEN", TOKEN, 1)
    assert.are.same({ TOKEN, "$WSYNC_SPEC_TOKEN" },
      { recipe.control_token(with({ tcp = "127.0.0.1:0", token_env = "WSYNC_SPEC_TOKEN" })) })
    ffi.C.setenv("WSYNC_SPEC_TOKEN", "short", 1)
    local token, message, field = recipe.control_token(with({ tcp = "127.0.0.1:0", token_env = "WSYNC_SPEC_TOKEN" }))
    assert.is_nil(token)
    assert.are.equal("control.token_env", field)
    assert.matches("must be at least 16 characters of letters, digits and -._~ (it has 5)", message, 1, true)
    ffi.C.unsetenv("WSYNC_SPEC_TOKEN")
    token, message = recipe.control_token(with({ tcp = "127.0.0.1:0", token_env = "WSYNC_SPEC_TOKEN" }))
    assert.is_nil(token)
    assert.matches("the environment variable WSYNC_SPEC_TOKEN, which holds the TCP endpoint's token, is not set",
      message, 1, true)
    local path = os.tmpname()
    local file = assert(io.open(path, "w"))
    file:write("  " .. TOKEN .. "\n")
    file:close()
    assert.are.equal(TOKEN, (recipe.control_token(with({ tcp = "127.0.0.1:0", token_file = path }))))
    os.remove(path)
    token, message, field = recipe.control_token(with({ tcp = "127.0.0.1:0", token_file = path }))
    assert.is_nil(token)
    assert.are.equal("control.token_file", field)
    assert.matches("cannot read the TCP endpoint's token from " .. path, message, 1, true)
  end)
end)
