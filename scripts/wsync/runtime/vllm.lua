--- The vllm rollout runtime, host side. `wsync run` spawns a Python process
--- (`python3 -m wsync.vllm`, bindings/python/wsync/vllm) in its own process
--- group; it owns `vllm.LLM`, whose TP workers are vLLM's own, and speaks
--- wsync's control protocol on fd 3 like the reference runtime: the same
--- framing, ids, states and per-command timeouts, the same commands.
---
--- A recipe says `runtime = { kind = "vllm", tp = N, model = DIR, load =
--- "direct" | "native", vllm = { engine arguments }, python = "python3" }`.
--- Weights reach vLLM's resident parameters in one of two ways:
---   - "native": vLLM's own packed IPC weight update (`LLM.update_weights`,
---     vLLM 0.26's wire format, one call per chunk) reads each chunk from
---     wsync's packed buffer and runs vLLM's per-tensor loader;
---   - "direct" (the default): wsync's worker extension imports the packed
---     buffers once and copies each chunk into the resident parameters with
---     the loader plan of wsync.plan (one batched copy per chunk); the plan is
---     checked bitwise against vLLM's own loader in the first publication of
---     a session (`runtime.check`: "first", "every" or "never").
local cjson = require("cjson")
local errors = require("wsync.errors")

local M = {}

--- How weights reach vLLM: the recipe's `runtime.load`, "direct" by default.
M.LOADS = { direct = true, native = true }

--- The startup handshake's timeout when a recipe sets none: importing vLLM
--- takes 15-25 s, starting an engine another 20 s or more (30B: minutes).
M.STARTUP_SECONDS = 600

--- The Python that runs the runtime: the recipe's `runtime.python`, else
--- $WSYNC_PYTHON, else python3.
---@param runtime table
---@return string
function M.python(runtime)
  return runtime.python or os.getenv("WSYNC_PYTHON") or "python3"
end

local function shell_quote(text)
  return "'" .. tostring(text):gsub("'", "'\\''") .. "'"
end

-- What the Python side finds, without importing vLLM (15-25 s): the
-- interpreter's version and whether each module is there.
local PROBE = [[
import importlib.util, json, sys
found = {"python": sys.version.split()[0]}
for name in ("wsync.vllm", "vllm", "torch"):
    try:
        found[name] = importlib.util.find_spec(name) is not None
    except Exception as error:
        found[name] = False
print(json.dumps(found))
]]

local function read_json(path)
  local text = require("wsync.util").read_file(path)
  if not text then
    return nil, "cannot be read"
  end
  local ok, value = pcall(cjson.decode, text)
  if not ok or type(value) ~= "table" then
    return nil, "is not a JSON object"
  end
  return value
end

--- How the weight commands of a vllm runtime loading with `load` reach its
--- TP workers when the recipe does not say (`runtime.channel`): the direct
--- loader over wsync's socket to each worker (a command's trip 0.3-0.8 ms on
--- the H200, against 1.5-2.7 ms through vLLM's collective_rpc), vLLM's own
--- receiver (`native`) through vLLM's collective_rpc, on the worker's own
--- thread as vLLM runs it (its per-chunk load takes about 100 ms anyway).
---@param load string?  "direct" (default) or "native"
---@param channel string?  the recipe's runtime.channel
---@return string
function M.channel(load, channel)
  return channel or ((load or "direct") == "native" and "rpc" or "socket")
end

--- The model directory of a recipe's vllm runtime: `runtime.model`, a
--- relative path taken from the recipe file's directory.
---@param recipe table
---@return string
function M.model_dir(recipe)
  local dir = recipe.runtime.model
  if dir:sub(1, 1) ~= "/" and recipe.path then
    local base = recipe.path:match("^(.*)/[^/]*$")
    if base then
      dir = base .. "/" .. dir
    end
  end
  return dir
end

--- Why this machine cannot run the vllm runtime of `recipe` (validated, with
--- a model): no config.json in `runtime.model`, one that describes another
--- model than the recipe's, no such Python, or no wsync or vLLM package
--- there. On the host backend (for tests of the protocol without vLLM or a
--- GPU) it needs an engine in place of vLLM: $WSYNC_VLLM_ENGINE
--- ("module:Class"). The message and the field, or nil when it can.
---@param recipe table
---@return string? message, string? field
function M.unavailable(recipe)
  local runtime, model = recipe.runtime, recipe.model
  local verify = require("wsync.recipe").verify_mode(recipe)
  if verify == "synthetic" then
    return "verify = true checks resident slices against wsync's synthetic values on the runtime's own storage; the "
      .. "vllm runtime checks verify = \"values\" (load = \"direct\") or nothing (verify = false)", "verify"
  elseif verify == "values" and (runtime.load or "direct") ~= "direct" then
    return "verify = \"values\" reads vLLM's parameters through wsync's loader: it needs load = \"direct\"", "verify"
  end
  if recipe.buffers and recipe.buffers.direct and (runtime.load or "direct") ~= "direct" then
    return "buffers.direct: vLLM's own packed update (load = \"native\") reads packed buffers; the trainer's own "
      .. "storage is read by wsync's loader (load = \"direct\")", "buffers.direct"
  end
  local config_path = M.model_dir(recipe) .. "/config.json"
  local config, why = read_json(config_path)
  if not config then
    return string.format("runtime.model: %s %s (vLLM serves the model of that directory; with load_format = "
      .. "\"dummy\" a config.json is enough)", config_path, why), "runtime.model"
  end
  if model then
    local family = require("wsync.plan").family(model.family)
    local ok, expected = pcall(family.config, model.config or model.preset)
    if ok then
      for _, key in ipairs(family.SHAPE_FIELDS or {}) do
        if config[key] ~= expected[key] then
          return string.format("runtime.model: %s says %s = %s; the recipe's model has %s", config_path, key,
            tostring(config[key]), tostring(expected[key])), "runtime.model"
        end
      end
      if (config.tie_word_embeddings == true) ~= expected.tie_word_embeddings then
        return string.format("runtime.model: %s says tie_word_embeddings = %s; the recipe's model has %s",
          config_path, tostring(config.tie_word_embeddings), tostring(expected.tie_word_embeddings)),
          "runtime.model"
      end
    end
  end
  local engine = os.getenv("WSYNC_VLLM_ENGINE")
  if recipe.backend == "host" and (engine == nil or engine == "") then
    return "backend 'host': vLLM runs on the cuda backend (the vllm runtime on the host backend needs an engine in "
      .. "place of vLLM, named by $WSYNC_VLLM_ENGINE, as the tests do)", "backend"
  end
  local python = M.python(runtime)
  local pipe = io.popen(string.format("%s -c %s 2>&1", shell_quote(python), shell_quote(PROBE)))
  local output = pipe and pipe:read("*a") or ""
  if pipe then
    pipe:close()
  end
  local last = nil -- (the probe prints one line; whatever it printed before is a warning)
  for line in output:gmatch("[^\n]+") do
    last = line
  end
  local ok, found = pcall(cjson.decode, last or "")
  if not ok or type(found) ~= "table" then
    return string.format("runtime.python: %s does not run (%s)", python, output:gsub("%s+$", "")), "runtime.python"
  end
  if not found["wsync.vllm"] then
    return string.format("runtime.python: %s (Python %s) cannot import wsync.vllm: install the Python package "
      .. "(pip install PATH/TO/wsync, the repository's root) or put bindings/python on PYTHONPATH", python,
      found.python), "runtime.python"
  end
  if not found.vllm and (engine == nil or engine == "") then
    return string.format("runtime.python: %s (Python %s) has no vllm package (the vllm runtime needs vLLM 0.26)",
      python, found.python), "runtime.python"
  end
  return nil
end

---@class wsync.VllmRuntimeOptions: wsync.RuntimeSpawnOptions
---@field model string     the model directory
---@field load string?     "direct" or "native"
---@field check string?    when the direct loader is checked against vLLM's: "first", "every", "never"
---@field channel string?  how weight commands reach vLLM's workers: "socket" or "rpc" (collective_rpc); M.channel
---@field engine table?    engine arguments for vllm.LLM
---@field python string?

--- Spawns the runtime and returns its client after the handshake (`info`,
--- answered once vLLM's engine is up). Needs a coroutine.
---@param options wsync.VllmRuntimeOptions
---@param spawn_client fun(options: table, fields: table): wsync.RuntimeClient  adds what every kind shares
---@return wsync.RuntimeClient
function M.spawn(options, spawn_client)
  local load = options.load or "direct"
  if not M.LOADS[load] then
    errors.raise("RUNTIME_START", string.format("vllm runtime: load '%s' is neither direct nor native",
      tostring(load)))
  end
  if type(options.model) ~= "string" then
    errors.raise("RUNTIME_START", "vllm runtime: no model directory (runtime.model)")
  end
  local tp = options.tp or 1
  local timeouts_module = require("wsync.control.timeouts")
  local overrides = require("wsync.util").merged({ startup = M.STARTUP_SECONDS }, options.timeouts or {})
  local timeouts = timeouts_module.with(overrides)
  local python = M.python(options)
  return spawn_client(options, {
    name = "vllm runtime",
    argv = {
      python, "-m", "wsync.vllm",
      "--tp", tostring(tp),
      "--backend", options.backend or "cuda",
      "--devices", require("wsync.runtime").device_list(options),
      "--model", options.model,
      "--load", load,
      "--check", options.check or "first",
      "--channel", M.channel(load, options.channel),
      "--engine-args", cjson.encode(options.engine or {}),
      "--timeouts", cjson.encode(timeouts),
    },
    env = options.env,
    timeouts = timeouts,
  })
end

return M
