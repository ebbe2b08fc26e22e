--- The recipe's schema: every field a recipe may set, section by section
--- (model, trainer, runtime, buffers, memory, control, rollout, timeouts,
--- ...), its type, its bounds and why, its default, and each section's own
--- check; the recipe-wide check of a model recipe's topology is
--- wsync.recipe.topology's. Declared with wsync.recipe.schema, which
--- validates a table against it. Also what a field's value means where more
--- than one code reads it (verify_mode), and the schema of one dotted field
--- (schema_of: the command line's overrides and the messages that name a
--- field).
local schema = require("wsync.recipe.schema")
local topology = require("wsync.recipe.topology")

local M = {}

--- The largest integer a recipe may give for a count or a byte size: larger
--- ones are not exact in a Lua number (and print as -9223372036854775808 once
--- converted to an int64).
M.MAX_INTEGER = 2 ^ 53
local MAX_INTEGER_WHY = "2^53, the largest integer a Lua number holds exactly"
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
      -- line) that gives one drops the other (wsync.recipe.merge).
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
        -- wsync's to each worker (wsync.vllm.runtime.channels and wsync.vllm.worker.channel: no trip through vLLM's
        -- EngineCore per command; the direct loader's default), or vLLM's
        -- collective_rpc (native's default: wsync.runtime.vllm.channel).
        channel = schema.enum({ "rpc", "socket" }),
        vllm = schema.map({ item = schema.any({}) }),
        python = schema.string({}),
        -- What the reference runtime's TP workers hold, as vLLM holds it
        -- under this quantization ("fp8": the loader plan's float8 weights
        -- and float32 scales, which its loader quantizes into); the vllm
        -- runtime takes vLLM's own engine argument, runtime.vllm.quantization.
        quantization = schema.enum({ "fp8" }),
      },
      check = function(runtime)
        if runtime.quantization ~= nil and runtime.kind ~= "reference" then
          return false, string.format("is the reference runtime's; the %s runtime's quantization is its engine's "
            .. "(runtime.vllm.quantization for vLLM)", runtime.kind), "quantization"
        end
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
        -- (vLLM's own engine arguments, passed on as given; wsync's model of
        -- memory reads this one.)
        local utilization = (runtime.vllm or {}).gpu_memory_utilization
        if utilization ~= nil and (type(utilization) ~= "number" or not (utilization > 0 and utilization <= 1)) then
          return false, string.format("is vLLM's share of the device, a number above 0 and at most 1; got %s",
            type(utilization) == "number" and tostring(utilization) or "a " .. type(utilization)),
            "vllm.gpu_memory_utilization"
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
        -- A CUDA process's own memory before it holds anything of the run
        -- (its context), in the model of each device: wsync.plan.schedule's
        -- CONTEXT_BYTES unless given.
        context_bytes = byte_count,
        -- Whether the trainer's optimizer state exists when the runtime
        -- starts (a resumed run), or its first step makes it after the
        -- runtime started and the bootstrap ran (false: torch's optimizers
        -- make their state lazily).
        optimizer_at_start = schema.boolean({ default = true }),
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
    -- (wsync.control.endpoint, wsync.recipe.token).
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
      return topology.check(recipe)
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

--- The schema of the recipe field at the dotted `field` ("trainer.steps",
--- "model.config.hidden_size": a map's keys are any); nil when there is no
--- such field, with the dotted path of the record that lacks it ("" for the
--- recipe) and that record's schema.
---@param field string
---@return table? spec, string? parent, table? record
function M.schema_of(field)
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

return M
