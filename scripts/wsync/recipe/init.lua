--- Recipes: Lua files that return a table saying what wsync should do for one
--- model and topology.
---
--- A recipe runs in a restricted environment: the safe parts of the standard
--- library, `require` for wsync modules only, and no new globals. Its table is
--- validated against `M.schema`; every failure is a RECIPE_INVALID error that
--- names the file, the line and the field.
local errors = require("wsync.errors")
local schema = require("wsync.recipe.schema")

local M = {}

--- The largest integer a recipe may give for a count or a byte size: larger
--- ones are not exact in a Lua number (and print as -9223372036854775808 once
--- converted to an int64).
M.MAX_INTEGER = 2 ^ 53
local MAX_INTEGER_WHY = "2^53, the largest integer a Lua number holds exactly"
--- Trainer ranks (and as many TP workers) on the cuda backend: they share
--- one node's GPUs. A static bound: check does not query the GPU; the
--- publication's preflight matches every rank to its device. On the host
--- backend the bound is its device count.
M.MAX_RANKS = 1024
--- The longest timeout a recipe may give, in seconds: a week.
M.MAX_SECONDS = 7 * 24 * 3600

local function integer(min, default)
  return schema.number({ integer = true, min = min, max = M.MAX_INTEGER, max_why = MAX_INTEGER_WHY,
    default = default })
end
local rank_count = integer(1)
local byte_count = integer(0)
local seconds = schema.number({ min = 0.001, max = M.MAX_SECONDS, max_why = "a week" })

--- The keys a recipe's `timeouts` may set (wsync.control.timeouts says what
--- each bounds).
M.TIMEOUT_KEYS = {}
for index, entry in ipairs(require("wsync.control.timeouts").KEYS) do
  M.TIMEOUT_KEYS[index] = entry.key
end

local timeout_fields = {}
for _, key in ipairs(M.TIMEOUT_KEYS) do
  timeout_fields[key] = seconds
end

--- The recipe schema. A recipe with `run` runs that function; a recipe with
--- `model` runs publications (wsync.publish.session).
M.schema = schema.record({
  fields = {
    name = schema.string({ required = true, pattern = "^[%w_.-]+$" }),
    description = schema.string({}),
    backend = schema.enum({ "host", "cuda", default = "host" }),
    params = schema.map({ item = schema.scalar({}), default = {} }),
    run = schema.func({}),
    model = schema.record({
      fields = {
        family = schema.enum({ "qwen3_moe", default = "qwen3_moe" }),
        preset = schema.string({}),
        config = schema.map({ item = schema.any({}) }),
      },
      -- Two ways of giving the model: an override (extends, the command
      -- line) that gives one drops the other (M.merge).
      alternatives = { { "preset", "config" } },
      check = function(model)
        if (model.preset == nil) == (model.config == nil) then
          return false, "give exactly one of preset and config"
        end
        return true
      end,
    }),
    trainer = schema.record({
      fields = {
        kind = schema.enum({ "synthetic", "external", default = "synthetic" }),
        ranks = rank_count,
        steps = integer(1, 1),
        -- How a synthetic rank allocates its shards: "one" allocation for
        -- them all (the default), or one per "tensor" (as a PyTorch
        -- trainer's caching allocator gives each large tensor a segment of
        -- its own).
        storage = schema.enum({ "one", "tensor" }),
      },
      check = function(trainer)
        if trainer.storage ~= nil and trainer.kind == "external" then
          return false, "storage says how a synthetic trainer allocates its shards; an external trainer's "
            .. "tensors are its own (leave storage out)"
        end
        return true
      end,
    }),
    runtime = schema.record({
      fields = {
        kind = schema.enum({ "reference", "transformers", "vllm", default = "reference" }),
        tp = rank_count,
        -- Rollout replicas of `tp` workers each (data-parallel engines):
        -- trainer rank r feeds TP worker r % tp of replica r // tp.
        replicas = integer(1, 1),
        respawn = schema.boolean({ default = false }),
        grace_ms = schema.number({ integer = true, min = 0, max = M.MAX_SECONDS * 1000, max_why = "a week" }),
        -- The vllm runtime: the model directory vLLM serves (its config.json
        -- describes the recipe's model), how weights reach vLLM's resident
        -- parameters (wsync.runtime.vllm), engine arguments for vllm.LLM, and
        -- the Python that runs it.
        model = schema.string({}),
        load = schema.enum({ "direct", "native" }),
        -- When the direct loader is checked bitwise against vLLM's own
        -- loader: in the first publication of a session (default), every
        -- publication, or never.
        check = schema.enum({ "first", "every", "never" }),
        -- How the weight commands reach vLLM's TP workers: a socket of
        -- wsync's to each worker (wsync.vllm.channel: no trip through vLLM's
        -- EngineCore per command; the direct loader's default), or vLLM's
        -- collective_rpc (native's default: wsync.runtime.vllm.channel).
        channel = schema.enum({ "rpc", "socket" }),
        vllm = schema.map({ item = schema.any({}) }),
        python = schema.string({}),
      },
      check = function(runtime)
        if runtime.kind ~= "vllm" then
          for _, field in ipairs({ "model", "load", "check", "channel", "vllm", "python" }) do
            if runtime[field] ~= nil then
              return false, string.format("is for the vllm runtime; this recipe's runtime is %s", runtime.kind),
                field
            end
          end
        elseif runtime.model == nil then
          return false, "the vllm runtime needs the directory of the model it serves (a config.json at least)",
            "model"
        end
        return true
      end,
    }),
    buffers = schema.record({
      fields = {
        -- (Each packed buffer's size: required unless `direct`, which has
        -- none.)
        bytes = schema.number({ integer = true, min = 1, max = M.MAX_INTEGER, max_why = MAX_INTEGER_WHY }),
        count = schema.number({ integer = true, min = 1, max = 8, default = 2 }),
        -- One rank on the cuda backend: the TP worker copies straight from
        -- the trainer's own exported storage, no packed buffers.
        direct = schema.boolean({ default = false }),
        -- Who orders each chunk's fill and load: the host (it asks for the
        -- load once every rank's fill finished), or, on cuda, the device
        -- (both queued at once, each waiting on the device for the other:
        -- wsync.transport.cuda_ipc); "auto": the device where the packed
        -- buffers are cuda's and the runtime's workers can wait on it, the
        -- host otherwise.
        order = schema.enum({ "auto", "host", "device", default = "auto" }),
      },
      check = function(buffers)
        if buffers.bytes == nil and not buffers.direct then
          return false, "give bytes, the size of each packed buffer (or direct = true: none)"
        end
        return true
      end,
    }),
    memory = schema.record({
      fields = {
        device_bytes = byte_count,
        -- Bytes of optimizer state per byte of parameters: FP32 master
        -- weights and two Adam moments make 6 for BF16 parameters.
        optimizer_factor = schema.number({ min = 0, max = 64, max_why = "64 times the parameters' bytes",
          default = 6 }),
        gradients = schema.boolean({ default = true }),
        kv_bytes = integer(0, 0),
        headroom_bytes = integer(0, 0),
      },
      default = {},
    }),
    -- The control endpoint: its unix socket (`endpoint`: at that path,
    -- instead of one in a fresh private directory, for a launcher that hands
    -- it to the ranks), and a TCP socket at "ADDRESS:PORT" (port 0: any) for
    -- trainer ranks in other network namespaces, whose connections first
    -- prove the session's token: 128 random bits the host prints, or the one
    -- in the environment variable `token_env` or the file `token_file`
    -- (wsync.control.endpoint, M.control_token).
    control = schema.record({
      fields = {
        endpoint = schema.string({ pattern = "^[^%z]+$" }),
        tcp = schema.string({ pattern = "^%[?[%w%.:%-]+%]?:%d+$" }),
        token_env = schema.string({ pattern = "^[%a_][%w_]*$" }),
        token_file = schema.string({}),
      },
      check = function(control)
        for _, field in ipairs({ "token_env", "token_file" }) do
          if control[field] ~= nil and control.tcp == nil then
            return false, "gives the token of the TCP endpoint; this recipe has no control.tcp", field
          end
        end
        if control.token_env ~= nil and control.token_file ~= nil then
          return false, "give the token in one place: token_env or token_file", "token_file"
        end
        return true
      end,
    }),
    -- Requests the session keeps streaming in the rollout runtime from the
    -- bootstrap on, `stream` of them, `max_tokens` each: every round then
    -- says what they produced and under which model versions (the
    -- asynchronous RL demo, recipes/demo_async.lua).
    rollout = schema.record({
      fields = {
        stream = schema.number({ integer = true, min = 1, max = 1024, required = true }),
        max_tokens = schema.number({ integer = true, min = 1, max = 65536, default = 65536 }),
      },
    }),
    bootstrap = schema.list({ item = schema.any({}), default = {} }),
    schedule = schema.list({ item = schema.any({}) }),
    timeouts = schema.record({ fields = timeout_fields, default = {} }),
    -- After each publication: true or "synthetic" checks every resident
    -- slice against wsync's synthetic values (synthetic trainers, and
    -- trainers that write them); "values" against the trainer's own values
    -- (composable sums, wsync.plan.values; on cuda through host memory, for
    -- tests and small models).
    verify = schema.enum({ false, true, "synthetic", "values", default = false }),
  },
  check = function(recipe)
    if recipe.model then
      for _, field in ipairs({ "trainer", "runtime", "buffers", "schedule" }) do
        if recipe[field] == nil then
          return false, "a recipe with a model also needs " .. field, field
        end
      end
      if recipe.trainer.ranks == nil then
        return false, "is required", "trainer.ranks"
      end
      if recipe.runtime.tp == nil then
        return false, "is required", "runtime.tp"
      end
      local ranks = recipe.trainer.ranks
      local host_devices = recipe.backend == "host" and require("wsync.native.device").count("host")
      if host_devices and ranks > host_devices then
        return false, string.format("%d trainer ranks: the host backend has %d devices, one per trainer rank and its "
          .. "TP worker", ranks, host_devices), "trainer.ranks"
      elseif ranks > M.MAX_RANKS then
        return false, string.format("%d trainer ranks: at most %d on one node (its devices hold every rank and its TP "
          .. "worker)", ranks, M.MAX_RANKS), "trainer.ranks"
      end
      -- The publication's preflight refuses any other topology (trainer
      -- rank r and TP worker r share rank r's device).
      local replicas = recipe.runtime.replicas or 1
      if replicas == 1 and recipe.runtime.tp ~= recipe.trainer.ranks then
        return false, string.format("TP %d differs from the %d trainer ranks: TP worker r runs on trainer rank r's "
          .. "device, so runtime.tp must equal trainer.ranks", recipe.runtime.tp, recipe.trainer.ranks), "runtime.tp"
      elseif recipe.runtime.tp * replicas ~= recipe.trainer.ranks then
        return false, string.format("%d replicas x TP %d make %d TP workers for %d trainer ranks: each trainer rank "
          .. "feeds the TP worker on its device, so trainer.ranks must equal runtime.replicas x runtime.tp", replicas,
          recipe.runtime.tp, replicas * recipe.runtime.tp, recipe.trainer.ranks), "runtime.replicas"
      end
      if recipe.buffers.direct and (ranks ~= 1 or recipe.backend ~= "cuda") then
        return false, string.format("the direct path needs one trainer rank on the cuda backend (here %d on %s): "
          .. "several ranks gather their shards into packed buffers", ranks, recipe.backend), "buffers.direct"
      end
      if recipe.buffers.order == "device" and (recipe.backend ~= "cuda" or recipe.buffers.direct) then
        return false, string.format("chunks ordered on the device need the cuda backend's packed buffers (here %s%s)",
          recipe.backend, recipe.buffers.direct and ", the direct path" or ""), "buffers.order"
      end
    end
    return true
  end,
})

--- How a recipe checks what each publication left resident: false,
--- "synthetic" (verify = true) or "values".
---@param recipe table
---@return false|"synthetic"|"values"
function M.verify_mode(recipe)
  if recipe.verify == true then
    return "synthetic"
  end
  return recipe.verify or false
end

local copy = require("wsync.util").merged

local safe_globals = {
  "assert", "error", "ipairs", "next", "pairs", "pcall", "print", "rawequal",
  "rawget", "select", "tonumber", "tostring", "type", "unpack", "xpcall",
}

local load_table, invalid, extends_line

--- The environment a recipe chunk runs in. `loading` (from M.load) carries
--- the files being loaded, outermost first, for `extends`.
---@param path string
---@param loading {files: string[], stack: string[]}?
function M.environment(path, loading)
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

-- Splits "file:line: message" as Lua writes load and runtime errors. Lua
-- shortens a long file name to "..." and its tail; that form is accepted too.
-- A table with string keys only: merged key by key. Lists (schedule,
-- bootstrap), empty tables and values of other types replace.
local function is_record(value)
  return type(value) == "table" and next(value) ~= nil and rawget(value, 1) == nil
end

-- The fields of `record` ({name = spec}) that `name` replaces: the other
-- ways of giving it that the record's `alternatives` list (model.preset and
-- model.config).
local function alternatives_of(record, name)
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
--- `spec` (a schema record, M.schema by default) a field that the record's
--- `alternatives` make another way of giving a field replaces that other
--- one too: `model = {config = ...}` over a base's `model = {preset = ...}`
--- drops the preset. Neither argument is changed.
---@param base table
---@param overrides table
---@param spec table?
---@return table
function M.merge(base, overrides, spec)
  spec = spec or M.schema
  local fields = spec.kind == "record" and spec.fields or {}
  local result = {}
  for key, value in pairs(base) do
    result[key] = value
  end
  for key in pairs(overrides) do
    for _, other in ipairs(alternatives_of(spec, key)) do
      if overrides[other] == nil then
        result[other] = nil
      end
    end
  end
  for key, value in pairs(overrides) do
    if is_record(value) and is_record(result[key]) then
      result[key] = M.merge(result[key], value, fields[key] or schema.any({}))
    else
      result[key] = value
    end
  end
  return result
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
--- `overrides` (M.merge). The whole result is validated once, as the
--- extending recipe.
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
  return M.merge(load_table(resolved, loading), overrides)
end

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

-- The line of the first `extends(` call in the recipe at `path` (its return
-- line when there is none).
function extends_line(path)
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
      return extends_line(recipe.path), base .. ":" .. base_line
    end
  end
  return line or return_line(lines)
end

function invalid(path, message, fields)
  fields = fields or {}
  fields.file = path
  errors.raise("RECIPE_INVALID", message, fields)
end

-- Runs the recipe file at `path` in its restricted environment and returns
-- the table it returns, unvalidated. Raises RECIPE_INVALID naming the file
-- and line (of this file, or of a file it extends).
function load_table(path, loading)
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
    invalid(path, "a recipe must return a table, got " .. type(result), { line = M.field_line(path, "") })
  end
  return result
end

-- The schema of the recipe field at the dotted `field` ("trainer.steps",
-- "model.config.hidden_size": a map's keys are any); nil when there is no
-- such field, with the dotted path of the record that lacks it ("" for the
-- recipe) and that record's schema.
local function field_schema(field)
  local spec, walked = M.schema, {}
  for name in field:gmatch("[^.]+") do
    local parent = table.concat(walked, ".")
    if spec.kind == "record" then
      if not spec.fields[name] then
        return nil, parent, spec
      end
      spec = spec.fields[name]
    elseif spec.kind == "map" then
      spec = spec.item
    elseif spec.kind ~= "any" then
      return nil, parent, spec
    end
    walked[#walked + 1] = name
  end
  return spec
end

-- The names of a record's fields, sorted, as a message lists them.
local function field_names(record)
  return table.concat(require("wsync.util").sorted_keys(record.fields), ", ")
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
-- dropping what the field replaces (M.merge's alternatives).
local function set_field(raw, field, value)
  local names = {}
  for name in field:gmatch("[^.]+") do
    names[#names + 1] = name
  end
  local node, spec = raw, M.schema
  for index, name in ipairs(names) do
    local record = spec.kind == "record" and spec or nil
    for _, other in ipairs(alternatives_of(record, name)) do
      node[other] = nil
    end
    if index == #names then
      node[name] = value
      return
    end
    local child = type(node[name]) == "table" and copy(node[name]) or {}
    node[name] = child
    node = child
    spec = record and record.fields[name] or (spec.kind == "map" and spec.item) or schema.any({})
  end
end

-- Lays the command line's `key=value` overrides over the unvalidated recipe
-- table `raw` loaded from `path`: a key naming one of its parameters (or
-- params.NAME) is left for M.apply_overrides, any other names a field by
-- its dotted path (trainer.steps, runtime.tp, model.config.hidden_size).
-- Returns the parameters' overrides; raises USAGE for a key that names
-- neither, listing what there is.
local function apply_fields(raw, path, overrides)
  local params = type(raw.params) == "table" and raw.params or {}
  local sorted_keys = require("wsync.util").sorted_keys
  local for_params = {}
  for _, key in ipairs(sorted_keys(overrides)) do
    local text = overrides[key]
    local param = key:match("^params%.([^.]+)$") or (params[key] ~= nil and key) or nil
    if param then
      for_params[param] = text
    else
      local spec, parent, record = field_schema(key)
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

-- The override of `overrides` that set `field` or a field inside it, or
-- that a failure of `field` (a record's check) is about: its KEY=VALUE.
local function override_of(overrides, field)
  for key, text in pairs(overrides or {}) do
    local inside = field:sub(1, #key + 1)
    if key == field or key:sub(1, #field + 1) == field .. "." or inside == key .. "." or inside == key .. "[" then
      return key .. "=" .. text
    end
  end
  return nil
end

-- Where a record-level failure's `field` is given, when more than one file
-- gives it: " (model is given in child.lua:2 and base.lua:3)"; "" otherwise.
local function given_in(files, field)
  local spec = field ~= "" and field_schema(field)
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

--- Loads and validates a recipe file, with `overrides` (M.parse_overrides:
--- the command line's `key=value`) laid over it: parameters by name, any
--- other field by its dotted path, each value read as its field takes it.
--- Returns the validated recipe table, with `path` set, `files` (the recipe,
--- then each file it extends) and `overrides`; raises RECIPE_INVALID naming
--- file, line and field (a field inherited through `extends` at the
--- `extends` line, naming where it comes from; a field from the command line
--- naming its KEY=VALUE), USAGE for an override that names no parameter or
--- field or whose value its field does not take.
---@param path string
---@param overrides table<string, string>?
---@return table
function M.load(path, overrides)
  local loading = { files = {}, stack = {} }
  local result = load_table(path, loading)
  local for_params = overrides and apply_fields(result, path, overrides) or {}
  local recipe, failure = schema.check(M.schema, result)
  if not recipe then
    local word = override_of(overrides, failure.path)
    if word then
      invalid(path, string.format("field '%s': %s (set on the command line: %s)", failure.path, failure.message,
        word), { field = failure.path })
    end
    local line, inherited = M.field_location({ path = path, files = loading.files }, failure.path)
    invalid(path, string.format("field '%s': %s%s", failure.path, failure.message,
      inherited and (" (inherited from " .. inherited .. ")") or given_in(loading.files, failure.path)), {
      line = line,
      field = failure.path,
    })
  end
  recipe.path = path
  recipe.files = loading.files
  recipe.overrides = overrides or {}
  return M.apply_overrides(recipe, for_params)
end

-- Raises RECIPE_INVALID for `field` of a loaded recipe, at its line; a
-- field inherited through `extends` at the extends line, naming the base.
local function refuse(recipe, field, message)
  local word = override_of(recipe.overrides, field)
  if word then
    invalid(recipe.path, string.format("%s (set on the command line: %s)", message, word), { field = field })
  end
  local line, inherited = M.field_location(recipe, field)
  local origin = inherited and string.format(" (%s is inherited from %s)", field, inherited) or ""
  invalid(recipe.path, message .. origin, { line = line, field = field })
end

--- Builds the plan and checks the memory schedule of a recipe with a model,
--- and (unless `options.plan_only`) that this build and this machine can
--- serve it (wsync.recipe.prepare). Failures become RECIPE_INVALID naming
--- the file, the line and the field.
---@param recipe table  validated, with `path`
---@param options {plan_only: boolean?}?
---@return wsync.Plan plan, table topology, table memory_report
function M.check_plan(recipe, options)
  local ok, plan, topology, memory = pcall(require("wsync.recipe.prepare").prepare, recipe, options)
  if ok then
    return plan, topology, memory
  end
  local err = plan
  if errors.is(err) and err.code ~= "RECIPE_INVALID" then
    local field = err.field
    if err.code == "MODEL_UNSUPPORTED" then
      -- (The model's own field: one of the recipe's model.config, or the
      -- preset's.)
      field = recipe.model.config and field and ("model.config." .. field) or "model"
    end
    refuse(recipe, field or (err.code == "SCHEDULE_INVALID" and "schedule") or "model", err.message)
  end
  error(err, 0)
end

--- Refuses what `wsync run` would refuse before it starts anything, for
--- `wsync check` and `wsync run` alike: a recipe with nothing to run, and for
--- a model recipe what M.check_plan refuses. Raises RECIPE_INVALID naming
--- file:line and the field; returns a model recipe's plan, topology and
--- memory report.
---@param recipe table  validated, with `path`
---@param options {plan_only: boolean?}?
---@return wsync.Plan? plan, table? topology, table? memory_report
function M.check(recipe, options)
  if recipe.model then
    return M.check_plan(recipe, options)
  end
  if not recipe.run then
    invalid(recipe.path, "the recipe has nothing to run: it defines neither `run` nor `model`",
      { line = M.field_line(recipe.path, "") })
  end
  return nil
end

--- The shortest token a recipe may give its TCP endpoint, in characters.
M.MIN_TOKEN = 16

--- The token of a recipe's TCP control endpoint when the recipe says where
--- it is (`control.token_env`: an environment variable, `control.token_file`:
--- a file, relative to the working directory, its whitespace around it
--- ignored), and where that is ("$NAME", "the file PATH"); nil when it gives
--- none (the host draws one). Nil, a message and the field when the token
--- is not there, or shorter than M.MIN_TOKEN, or has characters other than
--- letters, digits and `-._~` (it travels in an endpoint's URL).
---@param recipe table  validated
---@return string? token, string where_or_message, string? field
function M.control_token(recipe)
  local control = recipe.control or {}
  local token, where, field
  if control.token_env then
    field, where = "control.token_env", "$" .. control.token_env
    token = os.getenv(control.token_env)
    if token == nil or token == "" then
      return nil, string.format("the environment variable %s, which holds the TCP endpoint's token, is not set",
        control.token_env), field
    end
  elseif control.token_file then
    field, where = "control.token_file", "the file " .. control.token_file
    local text, message = require("wsync.util").read_file(control.token_file)
    if not text then
      return nil, string.format("cannot read the TCP endpoint's token from %s: %s", control.token_file,
        tostring(message)), field
    end
    token = text:match("^%s*(.-)%s*$")
  else
    return nil, nil
  end
  if #token < M.MIN_TOKEN or not token:match("^[%w%-%._~]+$") then
    return nil, string.format("the token in %s must be at least %d characters of letters, digits and -._~ (it has "
      .. "%d); e.g. openssl rand -hex 16", where, M.MIN_TOKEN, #token), field
  end
  return token, where
end

--- The rollout runtimes this build has: the backends each one's TP workers
--- hold weights on, and whether it generates. A runtime added to the build
--- is added here (and to wsync.runtime.spawn): `check` and `run` refuse any
--- other, and what a runtime cannot do.
M.RUNTIMES = {
  -- (It generates with a toy decoder: wsync.runtime.decoder.)
  reference = { backends = { host = true, cuda = require("wsync").cuda_built or nil }, generates = true },
  -- (Its Python side, and vLLM there, are looked for by `probe`.)
  -- On the host backend only with an engine in place of vLLM
  -- ($WSYNC_VLLM_ENGINE; vLLM itself runs on cuda).
  vllm = { backends = { cuda = require("wsync").cuda_built or nil, host = true }, generates = true,
    probe = function(recipe)
      return require("wsync.runtime.vllm").unavailable(recipe)
    end },
}

-- What the CUDA runtime's error names mean for a person, when it cannot
-- count the GPUs.
local CUDA_COUNT_ERRORS = {
  cudaErrorInsufficientDriver = "no NVIDIA driver is loaded, or one too old for the CUDA %s runtime this wsync was "
    .. "built with",
  cudaErrorNoDevice = "the NVIDIA driver sees no GPU (CUDA_VISIBLE_DEVICES may hide them)",
}

--- Why the cuda backend cannot run here, in plain words: this build has no
--- CUDA, or this machine no usable GPU (and why, with CUDA's own words after
--- it). `reason` is what counting the devices answered (nil: it counted 0).
---@param reason string?
---@return string
function M.no_gpu(reason)
  local build = require("wsync").build
  if not build.cuda then
    return "backend 'cuda': this wsync was built without CUDA (no CUDA toolkit when it was built): it runs the host "
      .. "backend only"
  end
  local name = reason and reason:match("(cudaError%w+)")
  local plain = name and CUDA_COUNT_ERRORS[name]
  if plain then
    return string.format("backend 'cuda': this machine has no usable GPU: %s (CUDA says %s)",
      string.format(plain, tostring(build.cuda_toolkit)), name)
  end
  return string.format("backend 'cuda': this machine has no usable GPU (%s)", tostring(reason
    or "the CUDA runtime sees 0 devices"))
end

--- Why this build or machine cannot serve a model recipe: its runtime kind,
--- that runtime on its backend, no usable GPU (or fewer than the ranks) for
--- the cuda backend, or a schedule step the runtime cannot run. The message
--- and the field; nil when it can.
---@param recipe table  validated, with a model
---@return string? message, string? field
function M.unserved(recipe)
  local kind, backend = recipe.runtime.kind, recipe.backend
  local runtime = M.RUNTIMES[kind]
  local sorted_keys = require("wsync.util").sorted_keys
  if not runtime then
    local has = {}
    for _, name in ipairs(sorted_keys(M.RUNTIMES)) do
      has[#has + 1] = string.format("%s, on the %s backend", name,
        table.concat(sorted_keys(M.RUNTIMES[name].backends), " and "))
    end
    return string.format("runtime.kind '%s' is not in this build (this build has: %s)", kind,
      table.concat(has, "; ")), "runtime.kind"
  end
  if not runtime.backends[backend] then
    return string.format("backend '%s': this build's %s runtime holds weights on the %s backend only", backend, kind,
      table.concat(sorted_keys(runtime.backends), " and ")), "backend"
  end
  if backend == "cuda" then
    -- The devices the ranks need (counting them starts nothing and
    -- allocates nothing).
    local count, reason = require("wsync.native.device").count("cuda")
    if not count or count == 0 then
      return M.no_gpu(reason), "backend"
    end
    if recipe.trainer.ranks > count then
      return string.format("%d trainer ranks need %d GPUs, one each; this machine has %d", recipe.trainer.ranks,
        recipe.trainer.ranks, count), "trainer.ranks"
    end
  end
  if runtime.probe then
    local message, field = runtime.probe(recipe)
    if message then
      return message, field
    end
  end
  for index, step in ipairs(recipe.schedule or {}) do
    if step == "generate" and not runtime.generates then
      return string.format("schedule[%d] (generate): the %s runtime does not generate text", index, kind),
        string.format("schedule[%d]", index)
    end
  end
  return nil
end

local read_file = require("wsync.util").read_file

-- The soft limit called `name` ("Max open files") in /proc/self/limits (luv
-- 1.44 has no getrlimit); nil when it is unlimited or cannot be read.
local function soft_limit(name)
  return tonumber((read_file("/proc/self/limits") or ""):match("\n" .. name .. "%s+(%S+)"))
end

-- True when this process's forks are not held to RLIMIT_NPROC (Linux exempts
-- real uid 0 and CAP_SYS_ADMIN or CAP_SYS_RESOURCE in effect).
local function exempt_from_process_limit()
  local status = read_file("/proc/self/status") or ""
  if status:match("\nUid:%s+(%d+)") == "0" then
    return true
  end
  local effective = tonumber((status:match("\nCapEff:%s+(%x+)") or ""):sub(-8), 16)
  return effective ~= nil and require("bit").band(effective, 2 ^ 21 + 2 ^ 24) ~= 0
end

-- Files this process has open now.
local function open_files()
  local uv = require("luv")
  local scanner = uv.fs_scandir("/proc/self/fd")
  local count = 0
  while scanner and uv.fs_scandir_next(scanner) do
    count = count + 1
  end
  return math.max(count - 1, 0) -- not the directory being read
end

--- Files the host process opens for a run besides one per trainer rank and
--- TP worker: the control endpoint, the runtime's channel, the loop's handles
--- (measured with the demo at 1, 2 and 4 ranks: it runs under `ulimit -n`
--- of the files open before it + 5 + ranks, and fails under one less).
M.FILES_OF_A_RUN = 5

--- Refuses, before the plan is built, a model recipe that this build or
--- this machine cannot run: a runtime kind or backend this build does not
--- serve (M.RUNTIMES); more processes than RLIMIT_NPROC or open files than
--- RLIMIT_NOFILE allow (the schema bounds the ranks by the devices). Reads
--- limits only: allocates and starts nothing.
---@param recipe table  validated, with a model and `path`
function M.check_serve(recipe)
  local message, field = M.unserved(recipe)
  if message then
    refuse(recipe, field, message .. "; `wsync check --plan-only` checks its plan and schedule without running it")
  end
  local token, why, token_field = M.control_token(recipe)
  if not token and token_field then
    refuse(recipe, token_field, why)
  end
  local path = recipe.control and recipe.control.endpoint
  if path and #path > require("wsync.control.endpoint").MAX_SOCKET_PATH then
    refuse(recipe, "control.endpoint", string.format("%s is %d bytes; a unix socket's path takes at most %d", path,
      #path, require("wsync.control.endpoint").MAX_SOCKET_PATH))
  end

  local world, tp = recipe.trainer.ranks, recipe.runtime.tp
  local synthetic = recipe.trainer.kind == "synthetic" and world or 0
  local processes = synthetic + 1 + tp
  local process_limit = soft_limit("Max processes")
  if process_limit and processes > process_limit and not exempt_from_process_limit() then
    refuse(recipe, "trainer.ranks", string.format("the run starts %d processes (%d synthetic trainer ranks, the "
      .. "runtime's main process, %d TP workers); RLIMIT_NPROC (ulimit -u) allows this user %d", processes,
      synthetic, tp, process_limit))
  end
  local file_limit = soft_limit("Max open files")
  local open = open_files()
  local files = open + M.FILES_OF_A_RUN + math.max(world, tp)
  if file_limit and files > file_limit then
    refuse(recipe, "trainer.ranks", string.format("the host process needs at least %d open files for %d trainer ranks "
      .. "(%d open now, one per rank, %d for the endpoint, the runtime and the loop); RLIMIT_NOFILE (ulimit -n) "
      .. "allows %d", files, world, open, M.FILES_OF_A_RUN, file_limit))
  end
end

-- This machine's memory: physical, or the cgroup's limit when lower.
local function machine_memory()
  local uv = require("luv")
  local total = uv.get_total_memory()
  local constrained = uv.get_constrained_memory and uv.get_constrained_memory() or 0
  if constrained > 0 and constrained < total then
    return constrained, "the cgroup's memory limit"
  end
  return total, "physical memory"
end

--- Refuses a host-backend recipe whose run would hold more than this machine
--- has: the packed buffers (every rank's, in /dev/shm) beyond the free space
--- of /dev/shm, or the buffers, the trainer shards, the TP workers' resident
--- weights and KV arenas beyond its memory. Budgets and reserves
--- (memory.device_bytes, memory.headroom_bytes) are left to the schedule and
--- to the publication's preflight, which asks every device for its free
--- memory. A cuda recipe's device bytes are the devices': check does not
--- query the GPU, the preflight does.
---@param recipe table  validated, with a model and `path`
---@param plan wsync.Plan
---@param topology {world: integer, tp: integer}
---@param report table  wsync.plan.schedule.check's report (its `sizes`)
function M.check_machine(recipe, plan, topology, report)
  if recipe.backend ~= "host" then
    return
  end
  local uv = require("luv")
  local format_bytes = require("wsync.plan").format_bytes
  local sizes, world, tp = report.sizes, topology.world, topology.tp
  local buffers = world * sizes.buffers
  local shm = uv.fs_statfs and uv.fs_statfs("/dev/shm")
  if shm and buffers > shm.bavail * shm.bsize then
    local free = shm.bavail * shm.bsize
    refuse(recipe, "buffers.bytes", string.format("the packed buffers take %d bytes (%s) of /dev/shm (%d trainer "
      .. "ranks x %d buffers x %d bytes); it has %d bytes (%s) free", buffers, format_bytes(buffers), world,
      plan.buffer_count, plan.buffer_bytes, free, format_bytes(free)))
  end
  local parts = {
    { field = "buffers.bytes", what = "packed buffers", bytes = buffers },
    { field = "model", what = "trainer shards", bytes = plan.bytes },
    { field = "model", what = string.format("resident weights of %d TP workers", tp), bytes = tp * sizes.rollout },
    { field = "memory.kv_bytes", what = string.format("KV arenas of %d TP workers", tp), bytes = tp * sizes.kv_cache },
  }
  local total, largest, listed = 0, parts[1], {}
  for _, part in ipairs(parts) do
    total = total + part.bytes
    largest = part.bytes > largest.bytes and part or largest
    listed[#listed + 1] = string.format("%s %d", part.what, part.bytes)
  end
  local memory, what = machine_memory()
  if total > memory then
    refuse(recipe, largest.field, string.format("on the host backend every device is this machine's memory: the run "
      .. "holds %d bytes (%s: %s); the machine has %d bytes (%s, %s)", total, format_bytes(total),
      table.concat(listed, ", "), memory, format_bytes(memory), what))
  end
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
  local keys = require("wsync.util").sorted_keys(recipe.params)
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
