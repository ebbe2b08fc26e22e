--- Where a field of a recipe comes from, and the RECIPE_INVALID errors that
--- say so: the line where the recipe file writes it, found in its source;
--- for a field inherited through `extends`, the `extends` line and the base
--- file and line; for a field the command line set, its KEY=VALUE. Every
--- refusal of a recipe names the file, and the line and the field where
--- there is one, so that its reader knows what to change.
local errors = require("wsync.errors")
local fields = require("wsync.recipe.fields")

local M = {}

-- The lines of the file at `path` (none when it cannot be read).
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

-- The line where `field` is written in `lines`: each key of the dotted path
-- is looked for after the line of the key before it. Returns the line and
-- true when every key was found, the line of the deepest key found and false
-- when only a part was, nil when none was.
local function written_line(lines, field)
  local start = 1
  local found = nil
  for key in field:gmatch("[%a_][%w_]*") do
    local pattern = "[%s{,]" .. key .. "%s*="
    local pattern_at_start = "^" .. key .. "%s*="
    local this = nil
    for number = start, #lines do
      local text = lines[number]
      if text:match(pattern) or text:match(pattern_at_start) then
        this = number
        break
      end
    end
    if not this then
      return found, false
    end
    found, start = this, this
  end
  return found, found ~= nil
end

local function return_line(lines)
  for number = #lines, 1, -1 do
    if lines[number]:match("^%s*return") then
      return number
    end
  end
  return 1
end

--- The line where a field is written, found in the recipe's source: each key of
--- the dotted path is looked for after the line of the key before it. Falls
--- back to the last `return` line when the field is not written literally.
---@param path string  recipe file
---@param field string dotted field path ("params.steps", "steps[2].name")
function M.field_line(path, field)
  local lines = read_lines(path)
  return written_line(lines, field) or return_line(lines)
end

--- The line of the first `extends(` call in the recipe at `path` (its return
--- line when there is none).
---@param path string
---@return integer
function M.extends_line(path)
  local lines = read_lines(path)
  for number, text in ipairs(lines) do
    if text:match("extends%s*%(") and not text:match("^%s*%-%-") then
      return number
    end
  end
  return return_line(lines)
end

--- Where to report `field` of a loaded recipe: its line in the recipe file;
--- for a field inherited through `extends`, the line of the `extends` call
--- and the base file and line it comes from.
---@param recipe table  loaded (with `path` and `files`)
---@param field string
---@return integer line, string? inherited  "base.lua:12" when inherited
function M.field_location(recipe, field)
  local lines = read_lines(recipe.path)
  local line, complete = written_line(lines, field)
  if complete or field == "" then
    return line or return_line(lines)
  end
  for index = 2, #(recipe.files or {}) do
    local base = recipe.files[index]
    local base_line, base_complete = written_line(read_lines(base), field)
    if base_complete then
      return M.extends_line(recipe.path), base .. ":" .. base_line
    end
  end
  return line or return_line(lines)
end

--- The override of `overrides` (the command line's, parse_overrides of
--- wsync.recipe.overrides) that set `field` or a field inside it, or that a
--- failure of `field` (a record's check) is about: its KEY=VALUE; nil when
--- none did.
---@param overrides table<string, string>?
---@param field string
---@return string?
function M.override_of(overrides, field)
  for key, text in pairs(overrides or {}) do
    local inside = field:sub(1, #key + 1)
    if key == field or key:sub(1, #field + 1) == field .. "." or inside == key .. "." or inside == key .. "[" then
      return key .. "=" .. text
    end
  end
  return nil
end

--- Where a record-level failure's `field` is given, when more than one of
--- `files` (the recipe, then each file it extends) gives it: " (model is
--- given in child.lua:2 and base.lua:3)"; "" otherwise.
---@param files string[]
---@param field string
---@return string
function M.given_in(files, field)
  local spec = field ~= "" and fields.schema_of(field)
  if not spec or spec.kind ~= "record" then
    return ""
  end
  local places = {}
  for _, file in ipairs(files) do
    local line, complete = written_line(read_lines(file), field)
    if complete then
      places[#places + 1] = file .. ":" .. line
    end
  end
  if #places < 2 then
    return ""
  end
  return string.format(" (%s is given in %s)", field, table.concat(places, " and "))
end

--- Raises RECIPE_INVALID about the recipe file `path`: `message`, with
--- `error_fields` (its line, the field) beside the file.
---@param path string
---@param message string
---@param error_fields table?  line, field
function M.invalid(path, message, error_fields)
  error_fields = error_fields or {}
  error_fields.file = path
  errors.raise("RECIPE_INVALID", message, error_fields)
end

--- Raises RECIPE_INVALID for `field` of a loaded recipe, at its line; a
--- field inherited through `extends` at the extends line, naming the base; a
--- field the command line set naming its KEY=VALUE.
---@param recipe table  loaded (with `path`, `files` and `overrides`)
---@param field string
---@param message string
function M.refuse(recipe, field, message)
  local word = M.override_of(recipe.overrides, field)
  if word then
    M.invalid(recipe.path, string.format("%s (set on the command line: %s)", message, word), { field = field })
  end
  local line, inherited = M.field_location(recipe, field)
  local origin = inherited and string.format(" (%s is inherited from %s)", field, inherited) or ""
  M.invalid(recipe.path, message .. origin, { line = line, field = field })
end

return M
