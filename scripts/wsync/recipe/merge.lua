--- Recipes laid over each other: a base recipe and what `extends` gives over
--- it, a recipe and the fields the command line sets. Records merge field by
--- field; anything else replaces; giving one of a record's alternatives
--- (model.preset, model.config) drops the others.
local fields = require("wsync.recipe.fields")
local schema = require("wsync.recipe.schema")

local M = {}

-- A table with string keys only: merged key by key. Lists (schedule,
-- bootstrap), empty tables and values of other types replace.
local function is_record(value)
  return type(value) == "table" and next(value) ~= nil and rawget(value, 1) == nil
end

--- The fields of `record` ({name = spec}) that `name` replaces: the other
--- ways of giving it that the record's `alternatives` list (model.preset and
--- model.config). Empty for no record.
---@param record table?  a schema record
---@param name string
---@return string[]
function M.alternatives(record, name)
  local others = {}
  for _, group in ipairs(record and record.alternatives or {}) do
    for _, member in ipairs(group) do
      if member == name then
        for _, other in ipairs(group) do
          if other ~= name then
            others[#others + 1] = other
          end
        end
      end
    end
  end
  return others
end

--- `base` with `overrides` laid over it: records merge field by field (at
--- any depth), anything else in `overrides` replaces what `base` has. With
--- `spec` (a schema record, the recipe's schema by default) a field that the
--- record's `alternatives` make another way of giving a field replaces that
--- other one too: `model = {config = ...}` over a base's `model = {preset =
--- ...}` drops the preset. Neither argument is changed.
---@param base table
---@param overrides table
---@param spec table?
---@return table
function M.merge(base, overrides, spec)
  spec = spec or fields.schema
  local record_fields = spec.kind == "record" and spec.fields or {}
  local result = {}
  for key, value in pairs(base) do
    result[key] = value
  end
  for key in pairs(overrides) do
    for _, other in ipairs(M.alternatives(spec, key)) do
      if overrides[other] == nil then
        result[other] = nil
      end
    end
  end
  for key, value in pairs(overrides) do
    if is_record(value) and is_record(result[key]) then
      result[key] = M.merge(result[key], value, record_fields[key] or schema.any({}))
    else
      result[key] = value
    end
  end
  return result
end

return M
