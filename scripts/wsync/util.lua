--- Small helpers shared by wsync's modules.
local uv = require("luv")

local M = {}

--- The values `...` as a list with their count in `n` (nils kept).
---@return table
function M.pack(...)
  return { n = select("#", ...), ... }
end

--- A new table with the fields of `defaults`, then those of `overrides` laid
--- over them (one level; neither is changed).
---@param defaults table
---@param overrides table?
---@return table
function M.merged(defaults, overrides)
  local result = {}
  for key, value in pairs(defaults) do
    result[key] = value
  end
  for key, value in pairs(overrides or {}) do
    result[key] = value
  end
  return result
end

--- The whole text of the file at `path`, or nil and why it cannot be read.
---@param path string
---@return string?, string?
function M.read_file(path)
  local file, reason = io.open(path, "r")
  if not file then
    return nil, reason
  end
  local text = file:read("*a")
  file:close()
  return text
end

--- The entries of directory `parent` named for a process: an iterator of
--- (entry, creator pid) over the names that match `pattern` (its capture the
--- creator's pid).
---@param parent string
---@param pattern string
function M.named_entries(parent, pattern)
  local scanner = uv.fs_scandir(parent)
  return function()
    while scanner do
      local entry = uv.fs_scandir_next(scanner)
      if not entry then
        return nil
      end
      local pid = tonumber(entry:match(pattern))
      if pid then
        return entry, pid
      end
    end
  end
end

--- What processes of this user left in directory `parent` when they died
--- without removing it (SIGKILL): an iterator of (entry, path, creator pid,
--- lstat) over the entries M.named_entries finds, owned by this user, whose
--- creator is not this process and is gone. The caller removes what it
--- recognizes.
---@param parent string
---@param pattern string
function M.leftovers(parent, pattern)
  local entries = M.named_entries(parent, pattern)
  local own_uid = require("wsync._socket").own_uid()
  return function()
    for entry, pid in entries do
      local path = parent .. "/" .. entry
      local stat = pid ~= uv.os_getpid() and uv.fs_lstat(path)
      if stat and stat.uid == own_uid and select(3, uv.kill(pid, 0)) == "ESRCH" then
        return entry, path, pid, stat
      end
    end
  end
end

--- `count` random bytes from the kernel, in lowercase hexadecimal: tokens,
--- publication ids, marks.
---@param count integer
---@return string
function M.random_hex(count)
  return require("wsync.native.digest").hex(uv.random(count))
end

--- `method` bound to `object`: a function that returns method(object, ...).
---@param object table
---@param method function
---@return function
function M.bind(object, method)
  return function(...)
    return method(object, ...)
  end
end

--- Request handlers (the `handlers` of wsync.control.server and peer) that
--- forward to `object`'s methods: the handler of command `name` returns
--- `methods[name](object, payload, ...)`.
---@param object table
---@param methods table<string, fun(self: table, payload: table): table>
---@return table<string, fun(payload: table): table>
function M.method_handlers(object, methods)
  local handlers = {}
  for name, method in pairs(methods) do
    handlers[name] = M.bind(object, method)
  end
  return handlers
end

--- The value at `key` of every table in `list`, in the list's order.
---@param list table[]
---@param key any
---@return any[]
function M.field_values(list, key)
  local values = {}
  for index, item in ipairs(list) do
    values[index] = item[key]
  end
  return values
end

--- Appends `value` to `list` unless `seen` has it, and marks it in `seen`:
--- `list` then holds distinct values in the order they first came.
---@param list any[]
---@param seen table<any, boolean>
---@param value any
function M.append_unseen(list, seen, value)
  if not seen[value] then
    seen[value] = true
    list[#list + 1] = value
  end
end

--- The keys of `map`, sorted.
---@param map table
---@return any[]
function M.sorted_keys(map)
  local keys = {}
  for key in pairs(map) do
    keys[#keys + 1] = key
  end
  table.sort(keys)
  return keys
end

--- The environment for a child process, as uv.spawn takes it ("NAME=VALUE"
--- strings): this process's, with `entries` ("NAME=VALUE") replacing
--- variables of the same name.
---@param entries string[]?
---@return string[]
function M.environment(entries)
  local variables = uv.os_environ()
  for _, entry in ipairs(entries or {}) do
    local key, value = entry:match("^([^=]+)=(.*)$")
    variables[key] = value
  end
  local env = {}
  for key, value in pairs(variables) do
    env[#env + 1] = key .. "=" .. value
  end
  return env
end

--- This process's memory after a full collection: the Lua heap and the
--- resident set, in bytes (soak tests and `wsync repl` read them).
---@return {lua_heap_bytes: integer, rss_bytes: integer, pid: integer}
function M.memory_usage()
  collectgarbage("collect")
  collectgarbage("collect") -- finalizers of the first pass free more
  return {
    lua_heap_bytes = math.floor(collectgarbage("count") * 1024),
    rss_bytes = uv.resident_set_memory(),
    pid = uv.os_getpid(),
  }
end

-- JSON: sorted keys ---------------------------------------------------------------

--- The JSON null: a field that is there without a value (a report's slot
--- that nothing filled yet). The same value as lua-cjson's `cjson.null`.
M.json_null = require("cjson").null

local array_marker = {}

--- Marks `list` as a JSON array, so that it is `[]` when empty (an empty
--- table is `{}` otherwise). Returns `list`.
---@generic T: table
---@param list T
---@return T
function M.json_array(list)
  return setmetatable(list, array_marker)
end

local JSON_ESCAPES = { ['"'] = '\\"', ["\\"] = "\\\\", ["\b"] = "\\b", ["\f"] = "\\f", ["\n"] = "\\n",
  ["\r"] = "\\r", ["\t"] = "\\t" }

local function json_string(text)
  return '"' .. text:gsub('[%c"\\]', function(c)
    return JSON_ESCAPES[c] or string.format("\\u%04x", c:byte())
  end) .. '"'
end

-- True when `value`'s keys are 1..n (n >= 1), or it is marked an array.
local function is_array(value)
  if getmetatable(value) == array_marker then
    return true
  end
  local n = #value
  if n == 0 then
    return false
  end
  local keys = 0
  for _ in pairs(value) do
    keys = keys + 1
  end
  return keys == n
end

local function encode(value, out, depth)
  local kind = type(value)
  if value == nil or value == M.json_null then
    out[#out + 1] = "null"
  elseif kind == "boolean" then
    out[#out + 1] = value and "true" or "false"
  elseif kind == "number" then
    if value ~= value or value == math.huge or value == -math.huge then
      error("json: cannot encode " .. tostring(value), 0)
    end
    if value == math.floor(value) and math.abs(value) < 2 ^ 53 then
      out[#out + 1] = string.format("%d", value)
    else
      out[#out + 1] = string.format("%.14g", value)
    end
  elseif kind == "string" then
    out[#out + 1] = json_string(value)
  elseif kind == "table" then
    if depth > 100 then
      error("json: nested more than 100 tables deep (a cycle?)", 0)
    end
    if is_array(value) then
      out[#out + 1] = "["
      for index = 1, #value do
        if index > 1 then
          out[#out + 1] = ","
        end
        encode(value[index], out, depth + 1)
      end
      out[#out + 1] = "]"
      return
    end
    for key in pairs(value) do
      if type(key) ~= "string" then
        error("json: an object key must be a string, not " .. type(key) .. " (" .. tostring(key) .. ")", 0)
      end
    end
    local keys = M.sorted_keys(value)
    out[#out + 1] = "{"
    for index, key in ipairs(keys) do
      if index > 1 then
        out[#out + 1] = ","
      end
      out[#out + 1] = json_string(key)
      out[#out + 1] = ":"
      encode(value[key], out, depth + 1)
    end
    out[#out + 1] = "}"
  else
    error("json: cannot encode a " .. kind, 0)
  end
end

--- JSON text of `value` that is the same for the same value: every object's
--- keys sorted (lua-cjson keeps a table's own order, which changes from run
--- to run). A table whose keys are 1..n is an array (M.json_array marks an
--- empty one), M.json_null is null; integral numbers below 2^53 are written
--- as integers, others with 14 significant digits. Raises on NaN, infinities,
--- functions and keys that are neither strings nor array indices.
---@param value any
---@return string
function M.json(value)
  local out = {}
  encode(value, out, 0)
  return table.concat(out)
end

local function executable(path)
  return path ~= nil and uv.fs_access(path, "X") and (uv.fs_stat(path) or {}).type == "file"
end

--- The wsync binary that this host starts its roles with (`wsync runtime`,
--- `wsync trainer`, `wsync guard`): the running executable when it is wsync; in an embedding
--- process (a trainer that loaded libwsync) $WSYNC_PROGRAM, else the `wsync`
--- beside libwsync (a build tree or a bundle), else `wsync` on PATH. Raises
--- PROGRAM_NOT_FOUND naming the places when none is there.
---@return string
function M.program()
  local own = uv.exepath()
  local image = require("wsync._core").image
  image = image and (uv.fs_realpath(image) or image)
  if image == nil or image == own then
    return own
  end
  local tried = {}
  local explicit = os.getenv("WSYNC_PROGRAM")
  if explicit and explicit ~= "" then
    if executable(explicit) then
      return explicit
    end
    require("wsync.errors").raise("PROGRAM_NOT_FOUND", string.format("WSYNC_PROGRAM=%s is not an executable file",
      explicit))
  end
  local beside = image:match("^(.*)/[^/]*$")
  if beside then
    local path = beside .. "/wsync"
    if executable(path) then
      return uv.fs_realpath(path) or path
    end
    tried[#tried + 1] = path
  end
  for directory in (os.getenv("PATH") or ""):gmatch("[^:]+") do
    local path = directory .. "/wsync"
    if executable(path) then
      return path
    end
  end
  tried[#tried + 1] = "wsync on PATH"
  require("wsync.errors").raise("PROGRAM_NOT_FOUND", string.format("this process embeds libwsync (%s) and starts "
    .. "wsync's own processes (`wsync runtime`, `wsync trainer`, `wsync guard`) from the wsync binary, but none was "
    .. "found (tried $WSYNC_PROGRAM, %s): set WSYNC_PROGRAM to the wsync binary", image, table.concat(tried, ", ")))
end

return M
