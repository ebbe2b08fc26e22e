--- The command line's `key=value` words over a recipe (`wsync check`,
--- `wsync run`, the embedded host): a key naming one of the recipe's
--- parameters sets it, converted to the type of its default; any other key
--- sets the field at that dotted path (trainer.steps, runtime.tp,
--- model.config.hidden_size), its text read as that field takes it, before
--- the recipe is validated. A key or a value that reads as neither is a
--- USAGE error that lists what there is.
local errors = require("wsync.errors")
local fields = require("wsync.recipe.fields")
local merge = require("wsync.recipe.merge")
local schema = require("wsync.recipe.schema")
local util = require("wsync.util")

local M = {}

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

-- The names of a record's fields, sorted, as a message lists them.
local function field_names(record)
  return table.concat(util.sorted_keys(record.fields), ", ")
end

-- A value written on the command line as Lua reads a table: `{...}` in an
-- empty environment. Nil and why when it is not one.
local function table_value(text)
  local chunk, message = loadstring("return " .. text, "=(command line)")
  if not chunk then
    return nil, message
  end
  local ok, value = pcall(setfenv(chunk, {}))
  if not ok or type(value) ~= "table" then
    return nil, ok and ("it gives " .. type(value)) or tostring(value)
  end
  return value
end

-- `text`, the value of `word` (KEY=VALUE) for the field of schema `spec`, as
-- that field takes it: a number, true or false, one of an enum's values, a
-- string, a Lua table `{...}` for a list, map or record; a field of any type
-- takes what the text reads as (true/false, a number, a table, else the
-- string). Raises USAGE when it reads as none.
local function field_value(spec, key, text)
  local function refuse(what)
    errors.raise("USAGE", string.format("%s takes %s, got '%s'", key, what, text))
  end
  local kind = spec.kind
  if kind == "number" then
    local number = tonumber(text)
    if not number or number ~= number or number == math.huge or number == -math.huge then
      refuse("a number")
    end
    return number
  elseif kind == "boolean" then
    local value = ({ ["true"] = true, ["false"] = false })[text]
    if value == nil then
      refuse("true or false")
    end
    return value
  elseif kind == "enum" then
    local names = {}
    for index, allowed in ipairs(spec.values) do
      if tostring(allowed) == text then
        return allowed
      end
      names[index] = tostring(allowed)
    end
    refuse("one of " .. table.concat(names, ", "))
  elseif kind == "string" then
    return text
  elseif kind == "function" then
    errors.raise("USAGE", string.format("%s is a function: it cannot be given on the command line", key))
  end
  if text:match("^%s*{") then
    local value, why = table_value(text)
    if value == nil then
      refuse("a Lua table (" .. tostring(why) .. ")")
    end
    return value
  elseif kind == "list" or kind == "map" or kind == "record" then
    refuse("a Lua table such as " .. key .. "={...}")
  end
  if text == "true" or text == "false" then
    return text == "true"
  end
  local number = tonumber(text)
  if number and number == number and number ~= math.huge and number ~= -math.huge then
    return number
  end
  return text
end

-- Sets the dotted `field` of the unvalidated recipe table `raw` to `value`,
-- copying the tables on the way (a recipe may share one between fields) and
-- dropping what the field replaces (wsync.recipe.merge's alternatives).
local function set_field(raw, field, value)
  local names = {}
  for name in field:gmatch("[^.]+") do
    names[#names + 1] = name
  end
  local node, spec = raw, fields.schema
  for index, name in ipairs(names) do
    local record = spec.kind == "record" and spec or nil
    for _, other in ipairs(merge.alternatives(record, name)) do
      node[other] = nil
    end
    if index == #names then
      node[name] = value
      return
    end
    local child = type(node[name]) == "table" and util.merged(node[name]) or {}
    node[name] = child
    node = child
    spec = record and record.fields[name] or (spec.kind == "map" and spec.item) or schema.any({})
  end
end

--- Lays the command line's `key=value` overrides over the unvalidated recipe
--- table `raw` loaded from `path`: a key naming one of its parameters (or
--- params.NAME) is left for M.apply_overrides, any other names a field by
--- its dotted path (trainer.steps, runtime.tp, model.config.hidden_size).
--- Returns the parameters' overrides; raises USAGE for a key that names
--- neither, listing what there is.
---@param raw table  as the recipe file returned it, not yet validated
---@param path string
---@param overrides table<string, string>
---@return table<string, string>
function M.apply_fields(raw, path, overrides)
  local params = type(raw.params) == "table" and raw.params or {}
  local for_params = {}
  for _, key in ipairs(util.sorted_keys(overrides)) do
    local text = overrides[key]
    local param = key:match("^params%.([^.]+)$") or (params[key] ~= nil and key) or nil
    if param then
      for_params[param] = text
    else
      local spec, parent, record = fields.schema_of(key)
      if not spec then
        local names = {}
        for name in pairs(params) do
          names[#names + 1] = tostring(name) -- (not yet validated: any key)
        end
        table.sort(names)
        local message = parent == "" and string.format("recipe %s has no parameter or field '%s' (parameters: %s; "
          .. "fields: %s)", path, key, #names > 0 and table.concat(names, ", ") or "none", field_names(record))
          or record.kind == "record" and string.format("recipe %s has no field '%s' (%s's fields: %s)", path, key,
            parent, field_names(record))
          or string.format("recipe %s has no field '%s': %s is not a table of fields", path, key, parent)
        errors.raise("USAGE", message)
      end
      set_field(raw, key, field_value(spec, key, text))
    end
  end
  return for_params
end

--- Applies `key=value` overrides to `recipe.params`, converting each value to
--- the type of the declared default. Raises USAGE for unknown keys or values
--- that do not convert.
---@param recipe table
---@param overrides table<string, string>
---@return table recipe
function M.apply_overrides(recipe, overrides)
  local keys = util.sorted_keys(recipe.params)
  for key, text in pairs(overrides) do
    local default = recipe.params[key]
    if default == nil then
      errors.raise("USAGE", string.format("recipe %s has no parameter '%s' (parameters: %s)",
        recipe.path, key, #keys > 0 and table.concat(keys, ", ") or "none"))
    end
    local value = text
    if type(default) == "number" then
      value = tonumber(text)
      if value and (value ~= value or value == math.huge or value == -math.huge) then
        value = nil -- inf and nan are not values a parameter can take
      end
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
