-- wsync.recipe.merge: recipes laid over each other, records field by field,
-- and the alternatives that giving one field drops.
local fields = require("wsync.recipe.fields")
local merge = require("wsync.recipe.merge")

describe("merge", function()
  it("merges records field by field and replaces lists and scalars", function()
    assert.are.same({ a = { x = 1, y = 20, z = { p = 1, q = 2 } }, list = { "c" }, n = 2, keep = true },
      merge.merge({ a = { x = 1, y = 2, z = { p = 1 } }, list = { "a", "b" }, n = 1, keep = true },
        { a = { y = 20, z = { q = 2 } }, list = { "c" }, n = 2 }))
    local base = { t = { x = 1 } }
    merge.merge(base, { t = { x = 2 } })
    assert.are.same({ t = { x = 1 } }, base, "the base is not changed")
    assert.are.same({ list = {} }, merge.merge({ list = { 1 } }, { list = {} }), "an empty table replaces")
  end)

  it("drops a record's alternatives to a field the overrides give, and keeps them when the overrides give both",
    function()
      local base = { model = { family = "qwen3_moe", preset = "tiny" } }
      assert.are.same({ model = { family = "qwen3_moe", config = { hidden_size = 64 } } },
        merge.merge(base, { model = { config = { hidden_size = 64 } } }))
      assert.are.same({ model = { family = "qwen3_moe", preset = "tiny", config = {} } },
        merge.merge(base, { model = { preset = "tiny", config = {} } }), "the schema then refuses both")
      assert.are.same({ model = { preset = "tiny", config = { x = 1 } } },
        merge.merge({ model = { preset = "tiny" } }, { model = { config = { x = 1 } } }, { kind = "any" }),
        "a spec without alternatives drops nothing")
    end)
end)

describe("alternatives", function()
  it("names the other ways of giving a field that the record lists", function()
    local model = fields.schema.fields.model
    assert.are.same({ "config" }, merge.alternatives(model, "preset"))
    assert.are.same({ "preset" }, merge.alternatives(model, "config"))
    assert.are.same({}, merge.alternatives(model, "family"))
    assert.are.same({}, merge.alternatives(nil, "preset"), "no record, no alternatives")
  end)
end)
