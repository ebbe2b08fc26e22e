-- wsync.recipe.overrides: the command line's key=value words, parameters by
-- name and any other field by its dotted path.
local load_module = require("wsync.recipe.load")
local overrides = require("wsync.recipe.overrides")
local prepare = require("wsync.recipe.prepare")
local fixtures = require("tests.helpers.fixtures")

local error_of = require("tests.helpers.errors").error_of

describe("parameter overrides", function()
  local function loaded()
    return load_module.load(fixtures.recipes .. "/good.lua")
  end

  it("parses key=value words, keeping '=' in values", function()
    assert.are.same({ steps = "5", label = "a=b", empty = "" },
      overrides.parse_overrides({ "steps=5", "label=a=b", "empty=" }))
  end)

  it("refuses words that are not key=value", function()
    for _, word in ipairs({ "steps", "=5", "5steps=1", "-x=1" }) do
      local err = error_of(overrides.parse_overrides, { word })
      assert.are.equal("USAGE", err.code)
      assert.matches("'" .. word .. "' is not a key=value parameter", err.message, 1, true)
    end
  end)

  it("converts values to the type of the default", function()
    local applied = overrides.apply_overrides(loaded(), { steps = "12", verbose = "true", label = "42" })
    assert.are.equal(12, applied.params.steps)
    assert.is_true(applied.params.verbose)
    assert.are.equal("42", applied.params.label)
    applied = overrides.apply_overrides(loaded(), { steps = "0x10", verbose = "false" })
    assert.are.equal(16, applied.params.steps)
    assert.is_false(applied.params.verbose)
  end)

  it("refuses an unknown key, listing the parameters", function()
    local err = error_of(overrides.apply_overrides, loaded(), { stpes = "1" })
    assert.are.equal("USAGE", err.code)
    assert.matches("has no parameter 'stpes' (parameters: label, steps, verbose)", err.message, 1, true)
  end)

  it("refuses values that do not convert", function()
    local err = error_of(overrides.apply_overrides, loaded(), { steps = "many" })
    assert.are.equal("USAGE", err.code)
    assert.are.equal("parameter 'steps' needs a number, got 'many'", err.message)
    err = error_of(overrides.apply_overrides, loaded(), { verbose = "yes" })
    assert.are.equal("parameter 'verbose' needs a boolean, got 'yes'", err.message)
  end)
end)

describe("field overrides", function()
  it("sets any field by its dotted path, reading each value as its field takes it", function()
    local loaded = load_module.load("recipes/demo.lua", { ["trainer.steps"] = "5", ["buffers.bytes"] = "1048576",
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
    assert.is_false(load_module.load("recipes/demo.lua", { verify = "false" }).verify)
  end)

  it("reads tables as Lua, and a field of any type as what its text reads as", function()
    local loaded = load_module.load("recipes/demo.lua", { schedule = '{ { wake = { "weights" } }, "publish" }',
      ["model.config"] = "{ hidden_size = 64 }" })
    assert.are.same({ { wake = { "weights" } }, "publish" }, loaded.schedule)
    assert.are.same({ hidden_size = 64 }, loaded.model.config)
    assert.is_nil(loaded.model.preset, "a config replaces the preset")
    loaded = load_module.load("recipes/demo.lua", { ["model.config.hidden_size"] = "64",
      ["model.config.tie_word_embeddings"] = "false", ["model.config.model_type"] = "qwen3_moe" })
    assert.are.same({ hidden_size = 64, tie_word_embeddings = false, model_type = "qwen3_moe" }, loaded.model.config)
    assert.is_nil(loaded.model.preset)
    local back = load_module.load(fixtures.recipes .. "/vllm_tiny_cuda.lua", { ["model.preset"] = "tiny" })
    assert.are.equal("tiny", back.model.preset)
  end)

  it("still takes the parameters by name, or as params.NAME", function()
    local loaded = load_module.load(fixtures.recipes .. "/good.lua", { steps = "12", ["params.verbose"] = "true" })
    assert.are.same({ steps = 12, verbose = true, label = "fixture" }, loaded.params)
    local err = error_of(load_module.load, fixtures.recipes .. "/good.lua", { ["params.nope"] = "1" })
    assert.are.equal("USAGE", err.code)
    assert.matches("has no parameter 'nope' (parameters: label, steps, verbose)", err.message, 1, true)
  end)

  it("refuses an unknown field, naming the fields there are", function()
    local err = error_of(load_module.load, "recipes/demo.lua", { ["trainer.stpes"] = "5" })
    assert.are.equal("USAGE", err.code)
    assert.are.equal("recipe recipes/demo.lua has no field 'trainer.stpes' (trainer's fields: kind, ranks, steps, "
      .. "storage)", err.message)
    err = error_of(load_module.load, "recipes/demo.lua", { colour = "blue" })
    assert.are.equal("USAGE", err.code)
    assert.matches("has no parameter or field 'colour' (parameters: none; fields: backend, bootstrap, ",
      err.message, 1, true)
    err = error_of(load_module.load, "recipes/demo.lua", { ["trainer.steps.x"] = "1" })
    assert.are.equal("recipe recipes/demo.lua has no field 'trainer.steps.x': trainer.steps is not a table of fields",
      err.message)
  end)

  it("refuses a value that does not read as its field's type", function()
    for key, text in pairs({ ["trainer.steps"] = "many", ["runtime.respawn"] = "yes", verify = "maybe",
      schedule = "publish", ["model.config"] = "{ x = }" }) do
      local err = error_of(load_module.load, "recipes/demo.lua", { [key] = text })
      assert.are.equal("USAGE", err.code, key)
      assert.matches("^" .. key:gsub("%p", "%%%0") .. " takes ", err.message)
    end
    local err = error_of(load_module.load, fixtures.recipes .. "/good.lua", { run = "x" })
    assert.are.equal("run is a function: it cannot be given on the command line", err.message)
  end)

  it("names the command line when the recipe refuses an overridden field", function()
    local err = error_of(load_module.load, "recipes/demo.lua", { ["trainer.steps"] = "0" })
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.are.equal("trainer.steps", err.field)
    assert.is_nil(err.line)
    assert.are.equal("field 'trainer.steps': must be at least 1, got 0 (set on the command line: trainer.steps=0)",
      err.message)
    err = error_of(prepare.check, load_module.load("recipes/demo.lua", { ["buffers.bytes"] = "1" }))
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.is_nil(err.line)
    assert.matches("raise buffers.bytes (set on the command line: buffers.bytes=1)", err.message, 1, true)
  end)
end)

describe("apply_fields", function()
  it("sets dotted fields of the raw table, copying what it shares, and leaves the parameters", function()
    local shared = { steps = 3 }
    local raw = { name = "r", params = { steps = 1 }, trainer = shared, model = { preset = "tiny" } }
    local for_params = overrides.apply_fields(raw, "r.lua", { steps = "5", ["trainer.steps"] = "7",
      ["model.config"] = "{ hidden_size = 64 }", ["params.label"] = "x" })
    assert.are.same({ steps = "5", label = "x" }, for_params, "the parameters' words, as text")
    assert.are.same({ steps = 1 }, raw.params, "applied after validation (apply_overrides)")
    assert.are.equal(7, raw.trainer.steps)
    assert.are.equal(3, shared.steps, "the recipe's own table is not changed")
    assert.are.same({ config = { hidden_size = 64 } }, raw.model, "a config replaces the preset")
  end)

  it("refuses a key that names no parameter and no field, listing what there is", function()
    local err = error_of(overrides.apply_fields, { params = { steps = 1 } }, "r.lua", { colour = "blue" })
    assert.are.equal("USAGE", err.code)
    assert.matches("^recipe r.lua has no parameter or field 'colour' %(parameters: steps; fields: backend, ",
      err.message)
  end)
end)
