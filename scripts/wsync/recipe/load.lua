--- Loading a recipe file: it runs in a restricted environment (the safe
--- parts of the standard library, `require` for wsync modules only, no new
--- globals, and `extends` to build on another recipe file), the command
--- line's overrides are laid over the table it returns
--- (wsync.recipe.overrides), and the whole is validated against the
--- recipe's schema (wsync.recipe.fields). Every failure is a RECIPE_INVALID
--- error that names the file, the line and the field (wsync.recipe.location),
--- or a USAGE error for an override that names nothing.
local errors = require("wsync.errors")
local fields = require("wsync.recipe.fields")
local location = require("wsync.recipe.location")
local merge = require("wsync.recipe.merge")
local overrides_module = require("wsync.recipe.overrides")
local schema = require("wsync.recipe.schema")
local util = require("wsync.util")

local M = {}

local safe_globals = {
  "assert", "error", "ipairs", "next", "pairs", "pcall", "print", "rawequal",
  "rawget", "select", "tonumber", "tostring", "type", "unpack", "xpcall",
}

local invalid, extends_line = location.invalid, location.extends_line
local evaluate

--- The environment a recipe chunk runs in. `loading` (from M.load) carries
--- the files being loaded, outermost first, for `extends`.
---@param path string
---@param loading {files: string[], stack: string[]}?
function M.environment(path, loading)
  local env = {}
  for _, name in ipairs(safe_globals) do
    env[name] = _G[name]
  end
  env.math, env.string, env.table = util.merged(math), util.merged(string), util.merged(table)
  env.os = { getenv = os.getenv, time = os.time, clock = os.clock, date = os.date }
  env.require = function(name)
    if type(name) == "string" and (name == "wsync" or name:match("^wsync%.")) then
      return require(name)
    end
    error(string.format("a recipe may only require wsync modules, not '%s'", tostring(name)), 2)
  end
  env.extends = function(base, overrides)
    -- `return extends(...)` is a tail call: its errors carry no line of the
    -- recipe, so they name the line of the call found in the source.
    if type(base) ~= "string" then
      invalid(path, "extends needs the path of a recipe file, got " .. type(base), { line = extends_line(path) })
    end
    if overrides ~= nil and type(overrides) ~= "table" then
      invalid(path, "extends takes a table of overrides, got " .. type(overrides), { line = extends_line(path) })
    end
    return M.extend(path, base, overrides or {}, loading or { files = { path }, stack = { path } })
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

local function dirname(path)
  return path:match("^(.*)/[^/]*$") or "."
end

-- `path` with "." and "dir/.." parts taken out (lexically), for messages.
local function normalize(path)
  local parts = {}
  for part in path:gmatch("[^/]+") do
    if part == ".." and #parts > 0 and parts[#parts] ~= ".." then
      parts[#parts] = nil
    elseif part ~= "." then
      parts[#parts + 1] = part
    end
  end
  local text = table.concat(parts, "/")
  if path:sub(1, 1) == "/" then
    return "/" .. text
  end
  return text ~= "" and text or "."
end

--- `extends(base, overrides)` as a recipe calls it from `path`: loads the
--- recipe file `base` (relative to `path`'s directory unless absolute) in its
--- own restricted environment, unvalidated, and returns it merged with
--- `overrides` (wsync.recipe.merge). The whole result is validated once,
--- as the extending recipe.
---@param path string  the extending recipe
---@param base string
---@param overrides table
---@param loading {files: string[], stack: string[]}
---@return table
function M.extend(path, base, overrides, loading)
  local resolved = normalize(base:sub(1, 1) == "/" and base or (dirname(path) .. "/" .. base))
  for _, file in ipairs(loading.stack) do
    if file == resolved then
      invalid(path, string.format("extends %s, which is already being loaded (a cycle)", base),
        { line = extends_line(path) })
    end
  end
  local file, reason = io.open(resolved, "r")
  if not file then
    invalid(path, string.format("extends %s: cannot open %s: %s", base, resolved,
      tostring(reason):gsub("^[^:]*: ", "")), { line = extends_line(path) })
  end
  file:close()
  return merge.merge(evaluate(resolved, loading), overrides)
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

--- Runs the recipe file at `path` in its restricted environment and returns
--- the table it returns, unvalidated. Raises RECIPE_INVALID naming the file
--- and line (of this file, or of a file it extends). `loading` gathers the
--- files loaded, outermost first, and the stack of those being loaded.
---@param path string
---@param loading {files: string[], stack: string[]}
---@return table
function evaluate(path, loading)
  local file = io.open(path, "r")
  if not file then
    local _, reason = io.open(path, "r")
    -- (No line: there is no file to point into.)
    invalid(path, "cannot open the recipe: " .. tostring(reason):gsub("^[^:]*: ", ""))
  end
  file:close()

  -- Source text only: LuaJIT loads bytecode unchecked, and a damaged
  -- bytecode file crashes the host (found with tests/fuzz).
  local chunk, load_message = loadfile(path, "t")
  if not chunk then
    if load_message:find("wrong mode", 1, true) then
      invalid(path, "the file is compiled Lua bytecode; a recipe must be Lua source text")
    end
    local line, message = split_location(load_message, path)
    invalid(path, "syntax error: " .. message, { line = line })
  end
  loading.files[#loading.files + 1] = path
  loading.stack[#loading.stack + 1] = normalize(path)
  setfenv(chunk, M.environment(path, loading))
  local ok, result = pcall(chunk)
  loading.stack[#loading.stack] = nil
  if not ok then
    if errors.is(result) then
      error(result, 0)
    end
    local line, message = split_location(tostring(result), path)
    invalid(path, message, { line = line })
  end
  if type(result) ~= "table" then
    invalid(path, "a recipe must return a table, got " .. type(result), { line = location.field_line(path, "") })
  end
  return result
end

--- Loads and validates a recipe file, with `overrides` (the command line's
--- `key=value`, wsync.recipe.overrides' parse_overrides) laid over it:
--- parameters by name, any other field by its dotted path, each value read
--- as its field takes it. Returns the validated recipe table, with `path`
--- set, `files` (the recipe, then each file it extends) and `overrides`;
--- raises RECIPE_INVALID naming file, line and field (a field inherited
--- through `extends` at the `extends` line, naming where it comes from; a
--- field from the command line naming its KEY=VALUE), USAGE for an override
--- that names no parameter or field or whose value its field does not take.
---@param path string
---@param overrides table<string, string>?
---@return table
function M.load(path, overrides)
  local loading = { files = {}, stack = {} }
  local result = evaluate(path, loading)
  local for_params = overrides and overrides_module.apply_fields(result, path, overrides) or {}
  local recipe, failure = schema.check(fields.schema, result)
  if not recipe then
    local word = location.override_of(overrides, failure.path)
    if word then
      invalid(path, string.format("field '%s': %s (set on the command line: %s)", failure.path, failure.message,
        word), { field = failure.path })
    end
    local line, inherited = location.field_location({ path = path, files = loading.files }, failure.path)
    invalid(path, string.format("field '%s': %s%s", failure.path, failure.message,
      inherited and (" (inherited from " .. inherited .. ")") or location.given_in(loading.files, failure.path)), {
      line = line,
      field = failure.path,
    })
  end
  recipe.path = path
  recipe.files = loading.files
  recipe.overrides = overrides or {}
  return overrides_module.apply_overrides(recipe, for_params)
end

return M
