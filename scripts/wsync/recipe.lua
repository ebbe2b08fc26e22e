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

--- The recipe schema. Later layers add fields (model, topology, schedule).
M.schema = schema.record({
  fields = {
    name = schema.string({ required = true, pattern = "^[%w_.-]+$" }),
    description = schema.string({}),
    backend = schema.enum({ "host", "cuda", default = "host" }),
    params = schema.map({ item = schema.scalar({}), default = {} }),
    run = schema.func({}),
  },
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
  "rawget", "rawlen", "select", "tonumber", "tostring", "type", "unpack", "xpcall",
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

-- Splits "file:line: message" as Lua writes load and runtime errors.
local function split_location(message, path)
  local prefix = path .. ":"
  if message:sub(1, #prefix) == prefix then
    local line, rest = message:sub(#prefix + 1):match("^(%d+): (.*)$")
    if line then
      return tonumber(line), rest
    end
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
