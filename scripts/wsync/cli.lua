--- The `wsync` command line: parses arguments, dispatches, maps errors to exit
--- codes. The C host calls `main(argv)` and exits with what it returns.
local errors = require("wsync.errors")

local M = {}

M.usage = [[
usage: wsync FILE.lua [ARGS...]        run a Lua file in the host (ARGS in `arg`)
       wsync -e CODE [ARGS...]         run a Lua chunk
       wsync run RECIPE [KEY=VALUE...] run a recipe, overriding its params
       wsync check RECIPE [KEY=VALUE...] [--json]
                                       load and validate a recipe; change nothing
       wsync repl [RECIPE]             interactive Lua with wsync loaded
       wsync test [BUSTED ARGS...]     run busted specs inside the host
       wsync --version                 print the version
       wsync --help                    print this help

Lua scripts come from the source tree when this binary runs from its build
directory, from the bytecode embedded in the binary otherwise; set
WSYNC_SCRIPTS=DIR (or WSYNC_SCRIPTS=embedded) to choose.

exit codes:
  0    success
  1    failure while running (the message says what failed and where)
  2    usage error (bad command line, unknown recipe parameter)
  3    invalid recipe or script (file:line and the field are named)
  130  interrupted (Ctrl-C)
]]

local function usage_error(message)
  errors.raise("USAGE", message .. " (see wsync --help)")
end

local function pack(...)
  return { n = select("#", ...), ... }
end

-- Runs fn(...) in a spawned coroutine and the loop until all work is done;
-- raises what fn or any callback raised.
local function run_on_loop(fn, ...)
  local loop = require("wsync.loop")
  local outcome = nil
  loop.spawn(fn, function(...)
    outcome = pack(...)
  end, ...)
  loop.run()
  if outcome and not outcome[1] then
    error(outcome[2], 0)
  end
end

--- Runs a chunk of Lua source, then the loop. Used by `-e` and ws_host_run_string.
---@param code string
---@param chunk_name string?
---@param args string[]?
function M.exec_string(code, chunk_name, args)
  local chunk, message = loadstring(code, chunk_name or "=(command line)")
  if not chunk then
    errors.raise("SCRIPT_INVALID", message)
  end
  run_on_loop(chunk, unpack(args or {}))
end

--- Runs a Lua file with `arg` set like the standalone interpreter sets it.
---@param path string
---@param args string[]
function M.exec_file(path, args)
  local chunk, message = loadfile(path)
  if not chunk then
    errors.raise("SCRIPT_INVALID", message)
  end
  local script_args = { [0] = path }
  for i, value in ipairs(args or {}) do
    script_args[i] = value
  end
  _G.arg = script_args
  run_on_loop(chunk, unpack(script_args))
end

--- Loads, validates and runs a recipe with `key=value` overrides.
---@param path string
---@param words string[]
function M.exec_recipe(path, words)
  local recipe_module = require("wsync.recipe")
  local recipe = recipe_module.load(path)
  recipe_module.apply_overrides(recipe, recipe_module.parse_overrides(words or {}))
  if not recipe.run then
    errors.raise("RECIPE_INVALID", "the recipe has nothing to run: it defines no `run` function",
      { file = path, line = recipe_module.field_line(path, "") })
  end
  run_on_loop(recipe.run, { recipe = recipe, params = recipe.params })
end

local commands = {}

function commands.run(args)
  if not args[1] then
    usage_error("wsync run needs a recipe file")
  end
  M.exec_recipe(args[1], { unpack(args, 2) })
  return 0
end

function commands.check(args)
  local json = false
  local words = {}
  for _, word in ipairs(args) do
    if word == "--json" then
      json = true
    else
      words[#words + 1] = word
    end
  end
  local path = table.remove(words, 1)
  if not path then
    usage_error("wsync check needs a recipe file")
  end
  local recipe_module = require("wsync.recipe")
  local recipe = recipe_module.load(path)
  recipe_module.apply_overrides(recipe, recipe_module.parse_overrides(words))
  local summary = {
    ok = true,
    recipe = recipe.name,
    path = path,
    backend = recipe.backend,
    params = recipe.params,
  }
  if json then
    io.stdout:write(require("cjson").encode(summary), "\n")
  else
    io.stdout:write(string.format("%s: ok: recipe %s, backend %s\n", path, recipe.name, recipe.backend))
    local keys = {}
    for key in pairs(recipe.params) do
      keys[#keys + 1] = key
    end
    table.sort(keys)
    for _, key in ipairs(keys) do
      io.stdout:write(string.format("  param %s = %s\n", key, tostring(recipe.params[key])))
    end
  end
  return 0
end

function commands.repl(args)
  if #args > 1 then
    usage_error("wsync repl takes at most one recipe")
  end
  local recipe = nil
  if args[1] then
    recipe = require("wsync.recipe").load(args[1])
  end
  return require("wsync.repl").start({ recipe = recipe })
end

function commands.test(args)
  return require("wsync.test").main(args)
end

function commands.help()
  io.stdout:write(M.usage)
  return 0
end

--- The command line entry point: returns the exit code.
---@param argv string[]
---@return integer
function M.main(argv)
  local ok, result = xpcall(function()
    local first = argv[1]
    if first == nil then
      io.stderr:write(M.usage)
      return 2
    elseif first == "--help" or first == "-h" or first == "help" then
      return commands.help()
    elseif first == "--version" or first == "-v" then
      io.stdout:write("wsync ", require("wsync").version, "\n")
      return 0
    elseif first == "-e" then
      if not argv[2] then
        usage_error("-e needs a chunk of Lua")
      end
      M.exec_string(argv[2], "=(command line)", { unpack(argv, 3) })
      return 0
    elseif commands[first] then
      return commands[first]({ unpack(argv, 2) })
    elseif first:match("%.lua$") or first:find("/", 1, true) then
      M.exec_file(first, { unpack(argv, 2) })
      return 0
    elseif first:sub(1, 1) == "-" then
      usage_error("unknown option '" .. first .. "'")
    else
      usage_error("unknown command '" .. first .. "'")
    end
  end, require("wsync._host").message_handler)
  if ok then
    return result or 0
  end
  -- The exit sentinel (os.exit) is not ours to handle: pass it to the host.
  if type(result) == "table" and getmetatable(result) and getmetatable(result).__name == "wsync exit" then
    error(result, 0)
  end
  -- A Lua error is a bug or a script error: show where. A wsync error says
  -- what to change; its traceback is noise unless asked for.
  local verbose = os.getenv("WSYNC_TRACEBACK") == "1" or not errors.is(result) or result.code == "LUA_ERROR"
  io.stderr:write("wsync: ", errors.format(result, verbose), "\n")
  return errors.exit_code(result)
end

return M
