--- Recipes: Lua files that return a table saying what wsync should do for one
--- model and topology. This module is their public face: what the command
--- line, the embedded host, the session and the tests call, each name taken
--- from the module that owns it.
---
--- A recipe runs in a restricted environment: the safe parts of the standard
--- library, `require` for wsync modules only, and no new globals. Its table is
--- validated against `M.schema`; every failure is a RECIPE_INVALID error that
--- names the file, the line and the field.
---
--- The modules under wsync.recipe, one concept each:
---
--- | module | what it owns |
--- | --- | --- |
--- | `schema` | declarative validation of plain tables (also the control messages') |
--- | `fields` | the recipe's schema: every section's fields, bounds, defaults and checks |
--- | `topology` | the model recipe's check across sections: ranks, TP, replicas, devices |
--- | `load` | the restricted environment, `extends`, loading and validating a file |
--- | `merge` | recipes laid over each other (`extends`, the command line) |
--- | `overrides` | the command line's `key=value`: parameters and dotted fields |
--- | `location` | where a field comes from, and the RECIPE_INVALID errors that name it |
--- | `token` | the TCP control endpoint's token, where the recipe says it is |
--- | `serve` | what this build and this machine can serve: runtimes, GPUs, limits, memory |
--- | `prepare` | the plan, the topology and the schedule; the check before a run |

-- (Required here, not on first use: the fuzz entry, tests/fuzz/entry.lua,
-- refuses any other require while a recipe loads.)
local fields = require("wsync.recipe.fields")
local load_module = require("wsync.recipe.load")
local location = require("wsync.recipe.location")
local merge = require("wsync.recipe.merge")
local overrides = require("wsync.recipe.overrides")
local prepare = require("wsync.recipe.prepare")
local serve = require("wsync.recipe.serve")
local token = require("wsync.recipe.token")
local topology = require("wsync.recipe.topology")

local M = {}

-- The schema and its bounds (wsync.recipe.fields, wsync.recipe.topology).
M.MAX_INTEGER = fields.MAX_INTEGER
M.MAX_RANKS = topology.MAX_RANKS
M.MAX_SECONDS = fields.MAX_SECONDS
M.TIMEOUT_KEYS = fields.TIMEOUT_KEYS
M.schema = fields.schema
M.verify_mode = fields.verify_mode

-- Loading a recipe file (wsync.recipe.load, wsync.recipe.merge,
-- wsync.recipe.overrides).
M.load = load_module.load
M.environment = load_module.environment
M.extend = load_module.extend
M.merge = merge.merge
M.parse_overrides = overrides.parse_overrides
M.apply_overrides = overrides.apply_overrides

-- Where a field is written (wsync.recipe.location).
M.field_line = location.field_line
M.field_location = location.field_location

-- The checks before a run (wsync.recipe.prepare, wsync.recipe.serve,
-- wsync.recipe.token).
M.check = prepare.check
M.check_plan = prepare.check_plan
M.RUNTIMES = serve.RUNTIMES
M.FILES_OF_A_RUN = serve.FILES_OF_A_RUN
M.no_gpu = serve.no_gpu
M.unserved = serve.unserved
M.check_serve = serve.check_serve
M.check_machine = serve.check_machine
M.MIN_TOKEN = token.MIN_TOKEN
M.control_token = token.control_token

return M
