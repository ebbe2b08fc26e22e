--- Readable text for Lua values, as the REPL prints them.
---
--- Strings come out quoted (`%q`, with newlines as `\n`); tables are expanded
--- with their array part first, then the other keys sorted (numbers, strings,
--- booleans, then the rest by `tostring`); a table that contains a table
--- already being printed shows `<cycle>`; tables deeper than `depth` show
--- `{...}`. A table that fits in `width` columns and has no nested table
--- written out in full stays on one line (`{ 1, 2, a = "x" }`); any other is
--- written one entry per line, indented. Functions, userdata, threads and
--- cdata show what `tostring` gives. Metatables are not followed: the table's
--- own (raw) contents are shown.
local M = {}

---@class wsync.InspectOptions
---@field depth integer?  table levels expanded before `{...}` (default 6)
---@field indent string?  one level of indentation (default two spaces)
---@field width integer?  columns a one-line table may take (default 72)

M.defaults = { depth = 6, indent = "  ", width = 72 }

local keywords = {}
for word in ([[and break do else elseif end false for function goto if in
  local nil not or repeat return then true until while]]):gmatch("%a+") do
  keywords[word] = true
end

local type_rank = { number = 1, string = 2, boolean = 3 }

-- Orders keys of mixed types: numbers, strings, booleans, then everything
-- else grouped by type and ordered by its text.
local function key_less(a, b)
  local type_a, type_b = type(a), type(b)
  if type_a ~= type_b then
    local rank_a, rank_b = type_rank[type_a] or 4, type_rank[type_b] or 4
    if rank_a ~= rank_b then
      return rank_a < rank_b
    end
    return type_a < type_b
  end
  if type_a == "number" or type_a == "string" then
    return a < b
  end
  if type_a == "boolean" then
    return b and not a
  end
  return tostring(a) < tostring(b)
end

--- `s` as a Lua string literal on one line.
---@param s string
---@return string
function M.quote(s)
  return (string.format("%q", s):gsub("\\\n", "\\n"))
end

local function plain(value)
  local ok, text = pcall(tostring, value)
  if ok and type(text) == "string" then
    return text
  end
  return "<" .. type(value) .. ">"
end

-- Length of the array part: the run of non-nil values from index 1.
local function array_length(t)
  local count = 0
  while rawget(t, count + 1) ~= nil do
    count = count + 1
  end
  return count
end

-- The keys of `value` outside its array part (1..`count`), sorted.
local function named_keys(value, count)
  local keys = {}
  for key in next, value do
    if not (type(key) == "number" and key >= 1 and key <= count and key % 1 == 0) then
      keys[#keys + 1] = key
    end
  end
  table.sort(keys, key_less)
  return keys
end

local render

-- True when `value` will be written as an expanded table (not as `{}`,
-- `{...}` or `<cycle>`) at `level`.
local function expands(value, state, level)
  return type(value) == "table" and next(value) ~= nil and not state.path[value] and level < state.depth
end

local function render_key(key, state, level)
  if type(key) == "string" and key:match("^[%a_][%w_]*$") and not keywords[key] then
    return key
  end
  return "[" .. render(key, state, level) .. "]"
end

-- Renders `value` found `level` tables deep; `state.path` holds the tables
-- being rendered around it.
function render(value, state, level)
  local kind = type(value)
  if kind == "string" then
    return M.quote(value)
  elseif kind ~= "table" then
    return plain(value)
  end
  if state.path[value] then
    return "<cycle>"
  end
  if next(value) == nil then
    return "{}"
  end
  if level >= state.depth then
    return "{...}"
  end
  state.path[value] = true
  local items = {}
  local nested = false
  local count = array_length(value)
  for index = 1, count do
    local item = rawget(value, index)
    nested = nested or expands(item, state, level + 1)
    items[#items + 1] = render(item, state, level + 1)
  end
  for _, key in ipairs(named_keys(value, count)) do
    local item = rawget(value, key)
    nested = nested or expands(item, state, level + 1) or expands(key, state, level + 1)
    items[#items + 1] = render_key(key, state, level + 1) .. " = " .. render(item, state, level + 1)
  end
  state.path[value] = nil

  if not nested then
    local line = "{ " .. table.concat(items, ", ") .. " }"
    if #line + #state.indent * level <= state.width then
      return line
    end
  end
  local inner = "\n" .. state.indent:rep(level + 1)
  return "{" .. inner .. table.concat(items, "," .. inner) .. "\n" .. state.indent:rep(level) .. "}"
end

--- Readable text for one value.
---@param value any
---@param options wsync.InspectOptions?
---@return string
function M.inspect(value, options)
  options = options or {}
  local state = {
    depth = options.depth or M.defaults.depth,
    indent = options.indent or M.defaults.indent,
    width = options.width or M.defaults.width,
    path = {},
  }
  return render(value, state, 0)
end

--- How many entries a summary shows.
M.SUMMARY_ENTRIES = 20

-- "{ 3 items }", "{ 9 fields }", "{ 2 items, 4 fields }": a table by its size.
local function size_of(t)
  local items = array_length(t)
  local fields = 0
  for key in next, t do
    if not (type(key) == "number" and key >= 1 and key <= items and key % 1 == 0) then
      fields = fields + 1
    end
  end
  local parts = {}
  if items > 0 then
    parts[#parts + 1] = items .. (items == 1 and " item" or " items")
  end
  if fields > 0 or items == 0 then
    parts[#parts + 1] = fields .. (fields == 1 and " field" or " fields")
  end
  return "{ " .. table.concat(parts, ", ") .. " }"
end

--- A few lines for a table too long to print whole: its entries one level
--- deep, at most M.SUMMARY_ENTRIES (a nested table written out when it fits
--- on a short line without tables of its own, its size otherwise; a long
--- string cut), after a first line that says how long the whole is and
--- `hint`, how to print it whole.
---@param value table
---@param lines integer  the lines the whole takes
---@param hint string
---@return string
function M.summary(value, lines, hint)
  local state = { depth = 1, indent = M.defaults.indent, width = 48, path = { [value] = true } }
  local keys = {}
  local count = array_length(value)
  for index = 1, count do
    keys[index] = index
  end
  for _, key in ipairs(named_keys(value, count)) do
    keys[#keys + 1] = key
  end
  local out = { string.format("{ -- %s, %d lines in full: %s", size_of(value):match("^{ (.*) }$"), lines, hint) }
  for index, key in ipairs(keys) do
    if index > M.SUMMARY_ENTRIES then
      out[#out + 1] = string.format("  ... %d more", #keys - M.SUMMARY_ENTRIES)
      break
    end
    local item = rawget(value, key)
    local text
    if type(item) == "table" then
      text = render(item, state, 0)
      if text:find("\n", 1, true) or text:find("{...}", 1, true) then
        text = size_of(item)
      end
    elseif type(item) == "string" and #item > 60 then
      text = M.quote(item:sub(1, 57)) .. "..."
    else
      text = render(item, state, 0)
    end
    out[#out + 1] = "  " .. (type(key) == "number" and key <= count and "" or render_key(key, state, 0) .. " = ")
      .. text .. ","
  end
  out[#out + 1] = "}"
  return table.concat(out, "\n")
end

--- Readable text for every argument (nils included), separated by tabs; the
--- empty string when there are none.
---@param ... any
---@return string
function M.inspect_values(...)
  local texts = {}
  for index = 1, select("#", ...) do
    texts[index] = M.inspect((select(index, ...)))
  end
  return table.concat(texts, "\t")
end

return M
