--- The `wsync` command line: parses arguments, dispatches, maps errors to exit
--- codes. The C host calls `main(argv)` and exits with what it returns.
local errors = require("wsync.errors")

local M = {}

M.usage = [[
usage: wsync FILE.lua [ARGS...]        run a Lua file in the host (ARGS in `arg`)
       wsync -e CODE [ARGS...]         run a Lua chunk
       wsync run RECIPE [KEY=VALUE...] [--report FILE.json]
                                       run a recipe: its publications (a model
                                       recipe) or its run function, with params;
                                       --report writes the run report (every
                                       round's steps and phases, timed; JSON),
                                       also when the run fails (run has no
                                       --json: the report is its JSON output)
       wsync check RECIPE [KEY=VALUE...] [--json] [--plan-only]
                                       load and validate a recipe and print its
                                       plan; allocate and start nothing; refuse
                                       what `run` would refuse (--plan-only: the
                                       plan and schedule alone, for a recipe
                                       meant for another machine or build;
                                       --json: one JSON object, sorted keys,
                                       errors included, on stdout)
       wsync repl [RECIPE]             interactive Lua with wsync loaded; with a
                                       model recipe, step through publications
       wsync repl --attach ENDPOINT    read a running host's live state (read-only)
       wsync test [BUSTED ARGS...]     run busted specs inside the host;
                                       --shuffle-files runs the spec files in a
                                       random order (--shuffle: the tests in
                                       each file too) and prints its seed;
                                       --seed=N with it runs that order again
       wsync --version                 print the version, the commit, the build
                                       type, and whether CUDA and NCCL are in
       wsync --help                    print this help

internal (started by wsync itself, not by hand):
       wsync runtime --tp N [--backend host] [--devices I,J,...]
                     [--weights-bytes B] [--kv-bytes B] [--timeouts JSON]
                                       the reference rollout runtime's main process;
                                       its control channel is fd 3
       wsync runtime-worker --rank R --world N --device I
                     --weights-bytes B --kv-bytes B
                                       one TP worker of the reference runtime
       wsync trainer [--endpoint ENDPOINT] --rank R --world N --model PRESET|JSON
                     [--versions N] [--backend host] [--device I]
                     [--storage one|tensor]
                                       a synthetic trainer rank (generated weights)
                                       that publishes N versions to the host, its
                                       shards in one allocation or one per tensor;
                                       ENDPOINT is the socket path or the
                                       tcp://ADDR:PORT?token=HEX the host prints
                                       (default: $WSYNC_ENDPOINT)
       wsync guard --host PID --mark NAME=VALUE [--grace-ms MS]
                                       ends the processes whose environment holds
                                       the mark once host PID exits or closes the
                                       guard's stdin (SIGTERM, SIGKILL after the
                                       grace period), then removes what they left

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

--- What `wsync --version` prints: the version, the commit and build type,
--- and whether CUDA and NCCL are built in.
---@return string
function M.version_text()
  local build = require("wsync").build
  return table.concat({
    "wsync " .. build.version,
    "commit  " .. build.commit,
    "build   " .. build.build_type,
    "cuda    " .. (build.cuda and string.format("built in (CUDA toolkit %s; the driver is loaded when the cuda "
      .. "backend is used)", tostring(build.cuda_toolkit)) or "not built in (no CUDA toolkit at build time): the host "
      .. "backend only"),
    "nccl    " .. (build.nccl and "built in (libnccl.so.2, or $WSYNC_NCCL_LIBRARY, is loaded when several ranks "
      .. "publish on cuda)" or "not built in (it comes with the cuda backend)"),
    "",
  }, "\n")
end

local function usage_error(message)
  errors.raise("USAGE", message .. " (see wsync --help)")
end

local pack = require("wsync.util").pack

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
--- `options.report` names the run report's file (JSON, wsync.publish.report):
--- written as the run goes, and also when the run fails or its recipe is
--- refused; a file that cannot be written is refused before anything runs.
---@param path string
---@param words string[]
---@param options {report: string?}?
function M.exec_recipe(path, words, options)
  local started, report_file = require("luv").hrtime() / 1e9, nil
  if options and options.report then
    local file, reason = io.open(options.report, "w")
    if not file then
      usage_error(string.format("cannot write the run report: %s", tostring(reason)))
    end
    report_file = file
  end
  local recipe = nil
  local ok, err = pcall(function()
    local recipe_module = require("wsync.recipe")
    recipe = recipe_module.load(path, recipe_module.parse_overrides(words or {}))
    -- Refused as `check` refuses it (exit 3, file:line and field) before
    -- anything starts: nothing to run, a plan or schedule that cannot work,
    -- what this build or machine cannot serve.
    recipe_module.check(recipe)
    if recipe.model then
      run_on_loop(function()
        require("wsync.publish.session").run(recipe, { report_file = report_file })
      end)
      return
    end
    run_on_loop(recipe.run, { recipe = recipe, params = recipe.params })
  end)
  if report_file and io.type(report_file) == "file" then
    -- (No session took the file: the recipe was refused, or it has no model.)
    require("wsync.publish.report").write_unopened(report_file, { recipe = recipe, path = path },
      not ok and err or nil, started)
  end
  if not ok then
    error(err, 0)
  end
end

local commands = {}

function commands.run(args)
  local words, report = {}, nil
  local i = 1
  while i <= #args do
    local word = args[i]
    if word == "--report" then
      report = args[i + 1] or usage_error("--report needs a file: the run report, JSON")
      i = i + 2
    elseif word:match("^%-%-report=") then
      report = word:sub(#"--report=" + 1)
      i = i + 1
    elseif word == "--json" then
      usage_error("wsync run prints its progress and closing report for people; its machine-readable output is "
        .. "the run report: wsync run RECIPE --report FILE.json (written also when the run fails)")
    else
      words[#words + 1] = word
      i = i + 1
    end
  end
  if not words[1] then
    usage_error("wsync run needs a recipe file")
  end
  M.exec_recipe(words[1], { unpack(words, 2) }, { report = report })
  return 0
end

-- Runs command `fn(args)` for `--json`: its failure is a JSON object on
-- stdout ({ok = false, error = {code, message, file, line, field, ...}, text,
-- exit_code, wsync}) instead of text on stderr, with the same exit code.
local function json_failures(fn, args)
  local ok, result = pcall(fn, args)
  if ok then
    return result
  end
  if errors.is_exit(result) then
    error(result, 0)
  end
  local err = errors.is(result) and result or errors.new("LUA_ERROR", tostring(result))
  local code = errors.exit_code(err)
  io.stdout:write(require("wsync.util").json({ ok = false, error = errors.fields(err), text = tostring(err),
    exit_code = code, wsync = require("wsync").build }), "\n")
  return code
end

local function check(args)
  local json, plan_only = false, false
  local words = {}
  for _, word in ipairs(args) do
    if word == "--json" then
      json = true
    elseif word == "--plan-only" then
      plan_only = true
    else
      words[#words + 1] = word
    end
  end
  local path = table.remove(words, 1)
  if not path then
    usage_error("wsync check needs a recipe file")
  end
  local recipe_module = require("wsync.recipe")
  local recipe = recipe_module.load(path, recipe_module.parse_overrides(words))
  local summary = {
    ok = true,
    recipe = recipe.name,
    path = path,
    backend = recipe.backend,
    params = recipe.params,
  }
  -- `check` refuses what `run` would refuse. With --plan-only it checks the
  -- plan and the schedule alone, for a recipe meant for another machine or
  -- build, and says whether this one can run it.
  plan_only = plan_only and recipe.model ~= nil
  local plan, topology, memory = recipe_module.check(recipe, { plan_only = plan_only })
  local unserved = plan_only and recipe_module.unserved(recipe) or nil
  if plan then
    for key, value in pairs(require("wsync.plan").summary(plan)) do
      summary[key] = value
    end
    summary.trainer_ranks, summary.tp = topology.world, topology.tp
    summary.peak_device_bytes, summary.peak_step = memory.peak, memory.peak_step
    summary.device_budget_bytes = memory.budget
    -- (The model's prediction after each step, per device: wsync.plan.schedule.)
    summary.memory_steps = memory.steps
    summary.memory_model = { context_bytes = memory.sizes.context, reservation_bytes = memory.sizes.reservation,
      asleep_bytes = memory.sizes.asleep, kv_cache_bytes = memory.sizes.kv_cache, unmodelled = memory.sizes.unmodelled }
    summary.runtime = { kind = recipe.runtime.kind, tp = topology.tp, replicas = topology.replicas }
    -- What TP rank 0 of the runtime holds (vLLM under its quantization):
    -- its tensors and bytes by dtype.
    local quantization = require("wsync.plan.schedule").engine_of(recipe).quantization
    local residents = require("wsync.plan").family(plan.family).rollout_residents(plan.config, topology.tp, 0,
      quantization)
    local by_dtype = {}
    for _, tensor in ipairs(residents.tensors) do
      local entry = by_dtype[tensor.dtype] or { tensors = 0, bytes = 0 }
      entry.tensors, entry.bytes = entry.tensors + 1, entry.bytes + tensor.bytes
      by_dtype[tensor.dtype] = entry
    end
    summary.rollout_residents = { quantization = quantization or "none", tensors = #residents.tensors,
      bytes = residents.bytes, by_dtype = by_dtype }
    if recipe.runtime.kind == "vllm" then
      summary.runtime.load = recipe.runtime.load or "direct"
      summary.runtime.channel = require("wsync.runtime.vllm").channel(recipe.runtime.load, recipe.runtime.channel)
      summary.runtime.model = require("wsync.runtime.vllm").model_dir(recipe)
    end
    summary.runs_here = unserved == nil
    summary.not_runnable = unserved
  end
  if json then
    summary.wsync = require("wsync").build
    io.stdout:write(require("wsync.util").json(summary), "\n")
    return 0
  end
  io.stdout:write(string.format("%s: %s: recipe %s, backend %s\n", path, plan_only and "plan ok" or "ok", recipe.name,
    recipe.backend))
  for _, key in ipairs(require("wsync.util").sorted_keys(recipe.params)) do
    io.stdout:write(string.format("  param %s = %s\n", key, tostring(recipe.params[key])))
  end
  if plan then
    local format_bytes = require("wsync.plan").format_bytes
    local lines = {
      string.format("model        %s (%s), FSDP%d -> %sTP%d", plan.family, recipe.model.preset or "config",
        topology.world, (topology.replicas or 1) > 1 and (topology.replicas .. " x ") or "", topology.tp),
      string.format("tensors      %d canonical (%d trainer tensors)", summary.tensors, summary.trainer_tensors),
      string.format("bytes        %d (%s)", summary.bytes, format_bytes(summary.bytes)),
      string.format("largest      %s, %d bytes (%s)", summary.largest_tensor, summary.largest_tensor_bytes,
        format_bytes(summary.largest_tensor_bytes)),
      string.format("chunks       %d, buffers %d x %d bytes (%s)", summary.chunks, summary.buffers,
        summary.buffer_bytes, format_bytes(summary.buffer_bytes)),
      string.format("peak memory  %d bytes (%s) per device, at %s; budget %s", memory.peak,
        format_bytes(memory.peak), memory.peak_step, memory.budget and format_bytes(memory.budget) or "not set"),
      string.format("manifest     %s", summary.manifest),
      string.format("runtime      %s %sTP%d%s", summary.runtime.kind, summary.runtime.replicas > 1
        and (summary.runtime.replicas .. " replicas x ") or "", summary.runtime.tp, summary.runtime.load
        and string.format(", load %s %s, model %s", summary.runtime.load, summary.runtime.channel == "socket"
          and "over wsync's socket" or "through vLLM's collective_rpc", summary.runtime.model) or ""),
    }
    local held = {}
    for _, dtype in ipairs(require("wsync.util").sorted_keys(summary.rollout_residents.by_dtype)) do
      local entry = summary.rollout_residents.by_dtype[dtype]
      held[#held + 1] = string.format("%s %d tensors, %s", dtype, entry.tensors, format_bytes(entry.bytes))
    end
    local rollout = summary.rollout_residents
    lines[#lines + 1] = string.format("rollout      TP rank 0 holds %d tensors, %s%s: %s", rollout.tensors,
      format_bytes(rollout.bytes), rollout.quantization ~= "none" and (" (quantization " .. rollout.quantization
        .. ")") or "", table.concat(held, "; "))
    if unserved then
      lines[#lines + 1] = string.format("runs here    no: %s; `wsync run` refuses it", unserved)
    end
    for _, line in ipairs(lines) do
      io.stdout:write("  ", line, "\n")
    end
    if memory.sizes.reservation then
      io.stdout:write(string.format("  engine       vLLM reserves %s of the device's %s (KV cache %s); asleep it keeps "
        .. "%s, and each process its CUDA context, %s\n", format_bytes(memory.sizes.reservation),
        format_bytes(memory.sizes.device_bytes), format_bytes(memory.sizes.kv_cache), format_bytes(memory.sizes.asleep),
        format_bytes(memory.sizes.context)))
    elseif memory.sizes.unmodelled then
      io.stdout:write(string.format("  not modelled %s\n", memory.sizes.unmodelled))
    end
    io.stdout:write("  schedule (predicted bytes per device after each step = trainer rank + TP worker):\n")
    for _, step in ipairs(memory.steps) do
      local after = step.after_bytes or step.bytes
      io.stdout:write(string.format("    %-14s %-20s %d (%s) = %s + %s%s\n", step.where, step.step, after,
        format_bytes(after), format_bytes(step.trainer_bytes), format_bytes(step.rollout_bytes),
        step.after_bytes and string.format("; %s while both run", format_bytes(step.bytes)) or ""))
    end
  end
  return 0
end

function commands.check(args)
  for _, word in ipairs(args) do
    if word == "--json" then
      return json_failures(check, args)
    end
  end
  return check(args)
end

function commands.repl(args)
  local globals = {}
  if args[1] == "--attach" then
    if not args[2] or args[3] then
      usage_error("wsync repl --attach takes one endpoint (the socket path the host printed)")
    end
    -- Connect first: an endpoint that cannot be reached starts no REPL.
    globals.host = require("wsync.cli.attach").open(args[2])
    return require("wsync.cli.repl").start({ globals = globals })
  end
  if #args > 1 then
    usage_error("wsync repl takes at most one recipe")
  end
  local recipe = nil
  if args[1] then
    recipe = require("wsync.recipe").load(args[1])
  end
  return require("wsync.cli.repl").start({ recipe = recipe })
end

function commands.test(args)
  return require("wsync.cli.test").main(args)
end

-- Parses `--name value` words into a table; raises USAGE on anything else.
local function parse_options(args, known)
  local options = {}
  local i = 1
  while i <= #args do
    local name = args[i]:match("^%-%-([%w-]+)$")
    if not name or not known[name] then
      usage_error(string.format("unexpected argument '%s'", args[i]))
    end
    if args[i + 1] == nil then
      usage_error(string.format("--%s needs a value", name))
    end
    local value = args[i + 1]
    if known[name] == "number" then
      value = tonumber(value)
      if not value or value < 0 or value ~= math.floor(value) then
        usage_error(string.format("--%s needs a non-negative integer, got '%s'", name, args[i + 1]))
      end
    end
    options[name] = value
    i = i + 2
  end
  return options
end

-- Refuses `wsync COMMAND` (USAGE) unless every option of `names` was given.
local function require_options(command, options, names)
  for _, name in ipairs(names) do
    if options[name] == nil then
      usage_error("wsync " .. command .. " needs --" .. name)
    end
  end
end

-- Runs a process role (runtime main or worker) until its loop has no work.
local function serve_role(start)
  local loop = require("wsync.loop")
  loop.spawn(start)
  loop.run()
  return 0
end

function commands.runtime(args)
  local options = parse_options(args, {
    tp = "number", backend = "string", devices = "string", ["weights-bytes"] = "number",
    ["kv-bytes"] = "number", timeouts = "string",
  })
  if not options.tp or options.tp < 1 then
    usage_error("wsync runtime needs --tp N (N >= 1)")
  end
  local devices = {}
  for index in (options.devices or ""):gmatch("[^,]+") do
    devices[#devices + 1] = tonumber(index) or usage_error("--devices takes device indices, got '" .. index .. "'")
  end
  local timeouts = {}
  if options.timeouts then
    local decoded_ok, decoded = pcall(require("cjson").decode, options.timeouts)
    if not decoded_ok or type(decoded) ~= "table" then
      usage_error("--timeouts takes a JSON object of seconds by command, got '" .. options.timeouts .. "'")
    end
    for key, value in pairs(decoded) do
      if type(key) ~= "string" or type(value) ~= "number" or value <= 0 then
        usage_error(string.format("--timeouts: %s = %s is not a positive number of seconds", tostring(key),
          tostring(value)))
      end
      timeouts[key] = value
    end
  end
  for rank = #devices + 1, options.tp do
    devices[rank] = rank - 1
  end
  if #devices ~= options.tp then
    usage_error(string.format("--devices names %d devices for --tp %d", #devices, options.tp))
  end
  return serve_role(function()
    require("wsync.runtime.reference").main({
      tp = options.tp,
      backend = options.backend or "host",
      devices = devices,
      weights_bytes = options["weights-bytes"] or 1048576,
      kv_bytes = options["kv-bytes"] or 1048576,
      timeouts = timeouts,
      fault = os.getenv("WSYNC_RUNTIME_FAULT"),
      program = require("wsync.util").program(),
    })
  end)
end

commands["runtime-worker"] = function(args)
  local options = parse_options(args, {
    rank = "number", world = "number", backend = "string", device = "number", ["weights-bytes"] = "number",
    ["kv-bytes"] = "number",
  })
  require_options("runtime-worker", options, { "rank", "world", "device", "weights-bytes", "kv-bytes" })
  return serve_role(function()
    require("wsync.runtime.worker").main({
      rank = options.rank,
      world = options.world,
      backend = options.backend or "host",
      device_index = options.device,
      weights_bytes = options["weights-bytes"],
      kv_bytes = options["kv-bytes"],
      fault = os.getenv("WSYNC_RUNTIME_FAULT"),
    })
  end)
end

function commands.trainer(args)
  local options = parse_options(args, {
    endpoint = "string", rank = "number", world = "number", model = "string", versions = "number",
    backend = "string", family = "string", device = "number", storage = "string",
  })
  if options.storage ~= nil and options.storage ~= "one" and options.storage ~= "tensor" then
    usage_error("wsync trainer --storage takes one or tensor, not '" .. tostring(options.storage) .. "'")
  end
  require_options("trainer", options, { "rank", "world", "model" })
  return serve_role(function()
    require("wsync.trainer.synthetic").main({
      endpoint = options.endpoint,
      rank = options.rank,
      world = options.world,
      family = options.family or "qwen3_moe",
      -- A preset name, or a config as a JSON object.
      model = options.model:sub(1, 1) == "{" and require("cjson").decode(options.model) or options.model,
      versions = options.versions or 1,
      backend = options.backend or "host",
      device_index = options.device,
      storage = options.storage,
    })
  end)
end

function commands.guard(args)
  local options = parse_options(args, { host = "number", mark = "string", ["grace-ms"] = "number" })
  if not options.host or options.host < 2 or not options.mark or not options.mark:find("=", 1, true) then
    usage_error("wsync guard needs --host PID and --mark NAME=VALUE")
  end
  local status = 0
  serve_role(function()
    status = require("wsync.control.guard").main({ host = options.host, mark = options.mark,
      grace_ms = options["grace-ms"] })
  end)
  return status
end

function commands.help()
  io.stdout:write(M.usage)
  return 0
end

--- The command line entry point: returns the exit code.
---@param argv string[]
---@return integer
function M.main(argv)
  -- (The command's loop runs all the time: its children's lines can come
  -- through it, prefixed.)
  require("wsync.output").enable()
  -- (Every child of the command line is the loop's: those it adopts while a
  -- runtime holds it as a subreaper are its to reap.)
  require("wsync.control.subreaper").claim_children()
  local ok, result = xpcall(function()
    local first = argv[1]
    if first == nil then
      io.stderr:write(M.usage)
      return 2
    elseif first == "--help" or first == "-h" or first == "help" then
      return commands.help()
    elseif first == "--version" or first == "-v" then
      io.stdout:write(M.version_text())
      return 0
    elseif first == "-e" then
      if not argv[2] then
        usage_error("-e needs a chunk of Lua")
      end
      M.exec_string(argv[2], "=(command line)", { unpack(argv, 3) })
      return 0
    elseif commands[first] and (argv[2] == "--help" or argv[2] == "-h") then
      -- (`wsync run --help`: the usage, not a recipe named --help.)
      return commands.help()
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
  if errors.is_exit(result) then
    error(result, 0)
  end
  -- An error the run printed already (its verdict) is not printed again.
  if errors.was_reported(result) then
    return errors.exit_code(result)
  end
  -- A Lua error is a bug or a script error: show where. A wsync error says
  -- what to change; its traceback is noise unless asked for.
  local verbose = os.getenv("WSYNC_TRACEBACK") == "1" or not errors.is(result) or result.code == "LUA_ERROR"
  -- One write: processes sharing this stderr (trainer ranks) do not interleave.
  io.stderr:write("wsync: " .. errors.format(result, verbose) .. "\n")
  return errors.exit_code(result)
end

return M
