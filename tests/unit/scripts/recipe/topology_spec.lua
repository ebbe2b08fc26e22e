-- wsync.recipe.topology: a model recipe's sections checked together: trainer
-- ranks, TP workers and replicas on the backend's devices, and the paths
-- only some topologies have.
local fields = require("wsync.recipe.fields")
local schema = require("wsync.recipe.schema")
local topology = require("wsync.recipe.topology")
local recipes = require("tests.helpers.recipes")

local model_recipe, refused = recipes.model, recipes.refused

describe("the ranks", function()
  it("refuses more trainer ranks than the host backend has devices, and than one node holds", function()
    local devices = require("wsync.native.device").count("host")
    assert.is_table(schema.check(fields.schema, model_recipe({ trainer = { ranks = devices },
      runtime = { tp = devices } })))
    local failure = refused({ trainer = { ranks = 100000 }, runtime = { tp = 100000 } })
    assert.are.equal("trainer.ranks", failure.path)
    assert.are.equal(string.format("100000 trainer ranks: the host backend has %d devices, one per trainer rank and "
      .. "its TP worker", devices), failure.message)
    -- cuda: a static bound (check does not query the GPU)
    assert.is_table(schema.check(fields.schema, model_recipe({ backend = "cuda", trainer = { ranks = 128 },
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

describe("buffers.order", function()
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

describe("check", function()
  -- A model recipe's sections, defaults filled, as the schema gives them to
  -- the check.
  local function sections(changes)
    local recipe = recipes.validated()
    for section, values in pairs(changes) do
      if type(values) == "table" then
        for key, value in pairs(values) do
          recipe[section][key] = value
        end
      else
        recipe[section] = values
      end
    end
    return recipe
  end

  it("passes the demo's topology", function()
    assert.are.same({ true }, { topology.check(recipes.validated()) })
  end)

  it("needs the trainer ranks and the TP size", function()
    local recipe = recipes.validated()
    recipe.trainer.ranks = nil
    assert.are.same({ false, "is required", "trainer.ranks" }, { topology.check(recipe) })
    recipe = recipes.validated()
    recipe.runtime.tp = nil
    assert.are.same({ false, "is required", "runtime.tp" }, { topology.check(recipe) })
  end)

  it("needs replicas x TP workers, one for each trainer rank", function()
    local ok, message, field = topology.check(sections({ trainer = { ranks = 4 }, runtime = { replicas = 3 } }))
    assert.is_false(ok)
    assert.are.equal("runtime.replicas", field)
    assert.are.equal("3 replicas x TP 2 make 6 TP workers for 4 trainer ranks: each trainer rank feeds the TP worker "
      .. "on its device, so trainer.ranks must equal runtime.replicas x runtime.tp", message)
    assert.is_true((topology.check(sections({ trainer = { ranks = 4 }, runtime = { replicas = 2 } }))))
  end)

  it("takes the direct path with one rank on cuda only", function()
    local ok, message, field = topology.check(sections({ trainer = { ranks = 1 }, runtime = { tp = 1 },
      buffers = { direct = true } }))
    assert.is_false(ok)
    assert.are.equal("buffers.direct", field)
    assert.are.equal("the direct path needs one trainer rank on the cuda backend (here 1 on host): several ranks "
      .. "gather their shards into packed buffers", message)
    assert.is_true((topology.check(sections({ backend = "cuda", trainer = { ranks = 1 }, runtime = { tp = 1 },
      buffers = { direct = true } }))))
  end)
end)

describe("of", function()
  it("gives the world, the TP size and the replicas, one replica unless given", function()
    assert.are.same({ world = 2, tp = 2, replicas = 1 }, topology.of(recipes.model()))
    assert.are.same({ world = 4, tp = 2, replicas = 2 }, topology.of(recipes.validated({ trainer = { ranks = 4 },
      runtime = { replicas = 2 } })))
  end)
end)
