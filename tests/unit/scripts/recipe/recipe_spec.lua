-- wsync.recipe: the public face. Each of its names is the object of the module
-- that owns it (whose spec tests it), so that a caller of wsync.recipe and one
-- of the module itself see one function and one table.
local recipe = require("wsync.recipe")

local OWNERS = {
  ["wsync.recipe.fields"] = { "MAX_INTEGER", "MAX_SECONDS", "TIMEOUT_KEYS", "schema", "verify_mode" },
  ["wsync.recipe.topology"] = { "MAX_RANKS" },
  ["wsync.recipe.load"] = { "load", "environment", "extend" },
  ["wsync.recipe.merge"] = { "merge" },
  ["wsync.recipe.overrides"] = { "parse_overrides", "apply_overrides" },
  ["wsync.recipe.location"] = { "field_line", "field_location" },
  ["wsync.recipe.prepare"] = { "check", "check_plan" },
  ["wsync.recipe.serve"] = { "RUNTIMES", "FILES_OF_A_RUN", "no_gpu", "unserved", "check_serve", "check_machine" },
  ["wsync.recipe.token"] = { "MIN_TOKEN", "control_token" },
}

describe("wsync.recipe", function()
  it("gives each name of its API from the module that owns it, and no other name", function()
    local given = {}
    for module, names in pairs(OWNERS) do
      for _, name in ipairs(names) do
        assert.is_not_nil(recipe[name], name)
        assert.are.equal(require(module)[name], recipe[name], name)
        given[name] = true
      end
    end
    for name in pairs(recipe) do
      assert.is_true(given[name], "wsync.recipe." .. name .. " is in no module's list here")
    end
  end)

  it("loads, overrides and checks a recipe as the command line does", function()
    local loaded = recipe.load("recipes/demo.lua", recipe.parse_overrides({ "trainer.steps=5" }))
    assert.are.equal(5, loaded.trainer.steps)
    local plan, topology = recipe.check(loaded, { plan_only = true })
    assert.are.equal(3, #plan.chunks)
    assert.are.same({ world = 2, tp = 2, replicas = 1 }, topology)
  end)
end)
