--- Declarative validation of plain Lua tables (recipes, payloads).
---
--- A schema is a table made by the constructors below. `check(schema, value)`
--- returns the value with defaults filled in, or nil plus a failure
--- `{path = "a.b[2]", message = "..."}` naming the first bad field.
local M = {}

---@class wsync.SchemaFailure
---@field path string   dotted path of the bad field ("" for the whole value)
---@field message string

local function join(path, key)
  if type(key) == "number" then
    return path .. "[" .. key .. "]"
  end
  key = tostring(key)
  return path == "" and key or (path .. "." .. key)
end

local function describe(value)
  if type(value) == "string" then
    return string.format("%q", value)
  end
  return type(value) == "table" and "a table" or tostring(value)
end

-- A bound as written in a message: an integer in full (2^53 reads
-- 9007199254740992, not 9.007199254741e+15), with its reason when it has one.
local function describe_bound(bound, why)
  local text = (bound == math.floor(bound) and math.abs(bound) < 2 ^ 63) and string.format("%d", bound)
    or tostring(bound)
  return why and (text .. " (" .. why .. ")") or text
end

local function fail(path, message, ...)
  error({ path = path, message = message:format(...) }, 0)
end

-- Fails unless `value` is of Lua type `kind`; `expected` says what was
-- expected in the message ("a string").
local function expect_type(value, kind, path, expected)
  if type(value) ~= kind then
    fail(path, "expected %s, got %s", expected, describe(value))
  end
end

local validators = {}

function validators.string(spec, value, path)
  expect_type(value, "string", path, "a string")
  if spec.pattern and not value:match(spec.pattern) then
    fail(path, "%s does not match %s", describe(value), spec.pattern)
  end
  return value
end

function validators.number(spec, value, path)
  expect_type(value, "number", path, "a number")
  if value ~= value or value == math.huge or value == -math.huge then
    fail(path, "expected a finite number, got %s", describe(value))
  end
  if spec.integer and value ~= math.floor(value) then
    fail(path, "expected an integer, got %s", describe(value))
  end
  if spec.min and value < spec.min then
    fail(path, "must be at least %s, got %s", describe_bound(spec.min), describe(value))
  end
  if spec.max and value > spec.max then
    fail(path, "must be at most %s, got %s", describe_bound(spec.max, spec.max_why), describe(value))
  end
  return value
end

function validators.boolean(_, value, path)
  expect_type(value, "boolean", path, "true or false")
  return value
end

function validators.enum(spec, value, path)
  for _, allowed in ipairs(spec.values) do
    if value == allowed then
      return value
    end
  end
  local names = {}
  for i, allowed in ipairs(spec.values) do
    names[i] = tostring(allowed)
  end
  fail(path, "expected one of %s, got %s", table.concat(names, ", "), describe(value))
end

validators["function"] = function(_, value, path)
  expect_type(value, "function", path, "a function")
  return value
end

function validators.scalar(_, value, path)
  local kind = type(value)
  if kind ~= "string" and kind ~= "number" and kind ~= "boolean" then
    fail(path, "expected a string, number or boolean, got %s", describe(value))
  end
  return value
end

function validators.any(_, value)
  return value
end

local check_value

function validators.list(spec, value, path)
  expect_type(value, "table", path, "a list")
  local count = #value
  for key in pairs(value) do
    if type(key) ~= "number" or key < 1 or key > count or key ~= math.floor(key) then
      fail(join(path, key), "unexpected key in a list")
    end
  end
  if spec.min_length and count < spec.min_length then
    fail(path, "needs at least %d entries, has %d", spec.min_length, count)
  end
  if spec.max_length and count > spec.max_length then
    fail(path, "takes at most %d entries, has %d", spec.max_length, count)
  end
  local result = {}
  for i = 1, count do
    result[i] = check_value(spec.item, value[i], join(path, i))
  end
  return result
end

function validators.map(spec, value, path)
  expect_type(value, "table", path, "a table")
  local result = {}
  for key, item in pairs(value) do
    if type(key) ~= "string" then
      fail(path, "keys must be strings, got %s", describe(key))
    end
    result[key] = check_value(spec.item, item, join(path, key))
  end
  return result
end

function validators.record(spec, value, path)
  expect_type(value, "table", path, "a table")
  for key in pairs(value) do
    if spec.fields[key] == nil and not spec.open then
      local known = {}
      for name in pairs(spec.fields) do
        known[#known + 1] = name
      end
      table.sort(known)
      fail(join(path, key), "unknown field (known: %s)", table.concat(known, ", "))
    end
  end
  local result = {}
  if spec.open then
    for key, item in pairs(value) do
      result[key] = item
    end
  end
  for name, field in pairs(spec.fields) do
    local item = value[name]
    if item == nil then
      if field.required then
        fail(join(path, name), "is required")
      end
      item = field.default
      if type(item) == "table" then
        item = check_value(field, item, join(path, name))
      end
    else
      item = check_value(field, item, join(path, name))
    end
    result[name] = item
  end
  if spec.check then
    local ok, message, field = spec.check(result)
    if not ok then
      fail(field and join(path, field) or path, "%s", message)
    end
  end
  return result
end

function check_value(spec, value, path)
  return validators[spec.kind](spec, value, path)
end

local function constructor(kind)
  return function(options)
    local spec = {}
    for key, value in pairs(options or {}) do
      spec[key] = value
    end
    spec.kind = kind
    return spec
  end
end

M.string = constructor("string")
--- `schema.number{integer = true, min = 1, max = 8, max_why = "..."}`:
--- `max_why` says in the refusal why the bound is there.
M.number = constructor("number")
M.boolean = constructor("boolean")
M.func = constructor("function")
M.scalar = constructor("scalar")
--- Accepts any value (a later stage validates it, e.g. schedule steps).
M.any = constructor("any")

--- `schema.enum{"a", "b", default = "a"}`
function M.enum(options)
  local spec = constructor("enum")(options)
  spec.values = {}
  for i, value in ipairs(options) do
    spec.values[i] = value
    spec[i] = nil
  end
  return spec
end

--- `schema.list{item = schema.string{}}`
M.list = constructor("list")
--- `schema.map{item = schema.number{}}`: string keys, uniform values.
M.map = constructor("map")
--- `schema.record{fields = {...}, open = false, check = fn(value)}`
M.record = constructor("record")

--- Validates `value`; returns the normalized value, or nil and a failure.
---@return any, wsync.SchemaFailure?
function M.check(spec, value)
  local ok, result = pcall(check_value, spec, value, "")
  if ok then
    return result
  end
  if type(result) == "table" and result.path then
    return nil, result
  end
  error(result, 0)
end

return M
