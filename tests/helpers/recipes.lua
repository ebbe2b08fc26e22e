--- Test helper: a model recipe as a table (recipes/demo.lua's shape), for
--- the specs of wsync.recipe's modules that check one without a file.
local fields = require("wsync.recipe.fields")
local merge = require("wsync.recipe.merge")
local schema = require("wsync.recipe.schema")

local M = {}

--- A model recipe as a table, with `changes` laid over it (wsync.recipe.merge).
---@param changes table?
---@return table
function M.model(changes)
  -- (On cuda each process also holds its CUDA context, about 0.5 GiB: a
  -- budget that holds two, wsync.plan.schedule.)
  local device_bytes = (changes or {}).backend == "cuda" and 2 * 1024 ^ 3 or 64 * 1024 * 1024
  return merge.merge({
    name = "model",
    backend = "host",
    model = { family = "qwen3_moe", preset = "tiny" },
    trainer = { kind = "synthetic", ranks = 2, steps = 3 },
    runtime = { kind = "reference", tp = 2 },
    buffers = { bytes = 160 * 1024, count = 2 },
    memory = { device_bytes = device_bytes, kv_bytes = 1024 * 1024 },
    schedule = { { wake = { "weights" } }, "publish" },
    timeouts = { load_chunk = 30 },
  }, changes or {})
end

--- The model recipe with `changes`, validated against the recipe's schema
--- (its defaults filled); raises when the schema refuses it.
---@param changes table?
---@return table
function M.validated(changes)
  local result, failure = schema.check(fields.schema, M.model(changes))
  -- (busted's assert.* is given to specs, not to the modules they require)
  assert(result, failure and failure.path .. ": " .. failure.message)
  return result
end

--- The schema failure of a model recipe with `changes`, asserting there is one.
---@param changes table?
---@return wsync.SchemaFailure
function M.refused(changes)
  local result, failure = schema.check(fields.schema, M.model(changes))
  assert(result == nil, "expected the schema to refuse the recipe")
  return failure
end

return M
