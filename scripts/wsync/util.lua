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
