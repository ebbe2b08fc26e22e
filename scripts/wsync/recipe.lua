--- Recipes: Lua files that return a table saying what wsync should do for one
--- model and topology.
---
--- A recipe runs in a restricted environment: the safe parts of the standard
--- library, `require` for wsync modules only, and no new globals. Its table is
--- validated against `M.schema`; every failure is a RECIPE_INVALID error that
--- names the file, the line and the field.
local errors = require("wsync.errors")
local schema = require("wsync.schema")

local M = {}

local positive_integer = schema.number({ integer = true, min = 1 })
local byte_count = schema.number({ integer = true, min = 0 })
local seconds = schema.number({ min = 0.001 })

--- Per-command timeouts in seconds (runtime commands and agent commands).
M.TIMEOUT_KEYS = {
  "startup", "info", "sleep", "wake", "shutdown", "checksum", "generate", "init", "start", "fill", "verify",
  "default", "init_weights", "start_update", "load_chunk", "finish_update", "resident_checksums", "callback",
  "publish", "release",
}

local timeout_fields = {}
for _, key in ipairs(M.TIMEOUT_KEYS) do
  timeout_fields[key] = seconds
end

--- The recipe schema. A recipe with `run` runs that function; a recipe with
--- `model` runs publications (wsync.session).
M.schema = schema.record({
  fields = {
    name = schema.string({ required = true, pattern = "^[%w_.-]+$" }),
    description = schema.string({}),
    backend = schema.enum({ "host", "cuda", default = "host" }),
    params = schema.map({ item = schema.scalar({}), default = {} }),
    run = schema.func({}),
    model = schema.record({
      fields = {
        family = schema.enum({ "qwen3_moe", default = "qwen3_moe" }),
        preset = schema.string({}),
        config = schema.map({ item = schema.any({}) }),
      },
      check = function(model)
        if (model.preset == nil) == (model.config == nil) then
          return false, "give exactly one of preset and config"
        end
        return true
      end,
    }),
    trainer = schema.record({
      fields = {
        kind = schema.enum({ "synthetic", "external", default = "synthetic" }),
        ranks = positive_integer,
        steps = schema.number({ integer = true, min = 1, default = 1 }),
      },
    }),
    runtime = schema.record({
      fields = {
        kind = schema.enum({ "reference", "transformers", "vllm", default = "reference" }),
        tp = positive_integer,
        respawn = schema.boolean({ default = false }),
        grace_ms = schema.number({ integer = true, min = 0 }),
      },
    }),
    buffers = schema.record({
      fields = {
        bytes = schema.number({ integer = true, min = 1, required = true }),
        count = schema.number({ integer = true, min = 1, max = 8, default = 2 }),
      },
    }),
    memory = schema.record({
      fields = {
        device_bytes = byte_count,
        optimizer_factor = schema.number({ min = 0, default = 6 }),
        gradients = schema.boolean({ default = true }),
        kv_bytes = schema.number({ integer = true, min = 0, default = 0 }),
        headroom_bytes = schema.number({ integer = true, min = 0, default = 0 }),
      },
      default = {},
    }),
    bootstrap = schema.list({ item = schema.any({}), default = {} }),
    schedule = schema.list({ item = schema.any({}) }),
    timeouts = schema.record({ fields = timeout_fields, default = {} }),
    verify = schema.boolean({ default = false }),
  },
  check = function(recipe)
    if recipe.model then
      for _, field in ipairs({ "trainer", "runtime", "buffers", "schedule" }) do
        if recipe[field] == nil then
          return false, "a recipe with a model also needs " .. field, field
        end
      end
      if recipe.trainer.ranks == nil then
        return false, "is required", "trainer.ranks"
      end
      if recipe.runtime.tp == nil then
        return false, "is required", "runtime.tp"
      end
    end
    return true
  end,
})

local function copy(source)
  local result = {}
  for key, value in pairs(source) do
    result[key] = value
  end
  return result
end

local safe_globals = {
  "assert", "error", "ipairs", "next", "pairs", "pcall", "print", "rawequal",
  "rawget", "select", "tonumber", "tostring", "type", "unpack", "xpcall",
}

--- The environment a recipe chunk runs in.
---@param path string
function M.environment(path)
  local env = {}
  for _, name in ipairs(safe_globals) do
    env[name] = _G[name]
  end
  env.math, env.string, env.table = copy(math), copy(string), copy(table)
  env.os = { getenv = os.getenv, time = os.time, clock = os.clock, date = os.date }
  env.require = function(name)
    if type(name) == "string" and (name == "wsync" or name:match("^wsync%.")) then
      return require(name)
    end
    error(string.format("a recipe may only require wsync modules, not '%s'", tostring(name)), 2)
  end
  return setmetatable(env, {
    __newindex = function(_, key)
      error(string.format("recipe %s sets the global '%s': use a local", path, tostring(key)), 2)
    end,
    __index = function(_, key)
      error(string.format("recipe %s reads the undefined global '%s'", path, tostring(key)), 2)
    end,
  })
end

-- Splits "file:line: message" as Lua writes load and runtime errors. Lua
-- shortens a long file name to "..." and its tail; that form is accepted too.
local function split_location(message, path)
  local prefix = path .. ":"
  local rest = nil
  if message:sub(1, #prefix) == prefix then
    rest = message:sub(#prefix + 1)
  else
    local tail = message:match("^%.%.%.(.-):%d+: ")
    if tail and #tail > 0 and path:sub(-#tail) == tail then
      rest = message:sub(#"..." + #tail + 2)
    end
  end
  local line, text = (rest or ""):match("^(%d+): (.*)$")
  if line then
    return tonumber(line), text
  end
  return nil, message
end

local function read_lines(path)
  local lines = {}
  local file = io.open(path, "r")
  if file then
    for line in file:lines() do
      lines[#lines + 1] = line
    end
    file:close()
  end
  return lines
end

--- The line where a field is written, found in the recipe's source: each key of
--- the dotted path is looked for after the line of the key before it. Falls
--- back to the last `return` line when the field is not written literally.
---@param path string  recipe file
---@param field string dotted field path ("params.steps", "steps[2].name")
function M.field_line(path, field)
  local lines = read_lines(path)
  local start = 1
  local found = nil
  for key in field:gmatch("[%a_][%w_]*") do
    local pattern = "[%s{,]" .. key .. "%s*="
    local pattern_at_start = "^" .. key .. "%s*="
    for number = start, #lines do
      local text = lines[number]
      if text:match(pattern) or text:match(pattern_at_start) then
        found, start = number, number
        break
      end
    end
  end
  if found then
    return found
  end
  for number = #lines, 1, -1 do
    if lines[number]:match("^%s*return") then
      return number
    end
  end
  return 1
end

local function invalid(path, message, fields)
  fields = fields or {}
  fields.file = path
  errors.raise("RECIPE_INVALID", message, fields)
end

--- Loads and validates a recipe file. Returns the validated recipe table, with
--- `path` set; raises RECIPE_INVALID naming file, line and field.
---@param path string
---@return table
function M.load(path)
  local file = io.open(path, "r")
  if not file then
    local _, reason = io.open(path, "r")
    invalid(path, "cannot open the recipe: " .. tostring(reason):gsub("^[^:]*: ", ""), { line = 0 })
  end
  file:close()

  local chunk, load_message = loadfile(path)
  if not chunk then
    local line, message = split_location(load_message, path)
    invalid(path, "syntax error: " .. message, { line = line })
  end
  setfenv(chunk, M.environment(path))
  local ok, result = pcall(chunk)
  if not ok then
    if errors.is(result) then
      error(result, 0)
    end
    local line, message = split_location(tostring(result), path)
    invalid(path, message, { line = line })
  end
  if type(result) ~= "table" then
    invalid(path, "a recipe must return a table, got " .. type(result), { line = M.field_line(path, "") })
  end

  local recipe, failure = schema.check(M.schema, result)
  if not recipe then
    invalid(path, string.format("field '%s': %s", failure.path, failure.message), {
      line = M.field_line(path, failure.path),
      field = failure.path,
    })
  end
  recipe.path = path
  return recipe
end

--- Builds the plan and checks the memory schedule of a recipe with a model.
--- Failures become RECIPE_INVALID naming the file, the line and the field.
---@param recipe table  validated, with `path`
---@return wsync.Plan plan, table topology, table memory_report
function M.check_plan(recipe)
  local ok, plan, topology, memory = pcall(require("wsync.session").prepare, recipe)
  if ok then
    return plan, topology, memory
  end
  local err = plan
  if errors.is(err) and err.code ~= "RECIPE_INVALID" then
    local field = err.field or (err.code == "SCHEDULE_INVALID" and "schedule") or "model"
    invalid(recipe.path, err.message, { line = M.field_line(recipe.path, field), field = field })
  end
  error(err, 0)
end

--- Parses `key=value` command-line words into a table of strings; raises a
--- USAGE error naming the word that is not one.
---@param words string[]
---@return table<string, string>
function M.parse_overrides(words)
  local overrides = {}
  for _, word in ipairs(words) do
    local key, value = word:match("^([%a_][%w_%.]*)=(.*)$")
    if not key then
      errors.raise("USAGE", string.format("'%s' is not a key=value parameter", word))
    end
    overrides[key] = value
  end
  return overrides
end

--- Applies `key=value` overrides to `recipe.params`, converting each value to
--- the type of the declared default. Raises USAGE for unknown keys or values
--- that do not convert.
---@param recipe table
---@param overrides table<string, string>
function M.apply_overrides(recipe, overrides)
  local keys = {}
  for key in pairs(recipe.params) do
    keys[#keys + 1] = key
  end
  table.sort(keys)
  for key, text in pairs(overrides) do
    local default = recipe.params[key]
    if default == nil then
      errors.raise("USAGE", string.format("recipe %s has no parameter '%s' (parameters: %s)",
        recipe.path, key, #keys > 0 and table.concat(keys, ", ") or "none"))
    end
    local value = text
    if type(default) == "number" then
      value = tonumber(text)
    elseif type(default) == "boolean" then
      value = ({ ["true"] = true, ["false"] = false })[text]
    end
    if value == nil then
      errors.raise("USAGE", string.format("parameter '%s' needs a %s, got '%s'", key, type(default), text))
    end
    recipe.params[key] = value
  end
  return recipe
end

return M
