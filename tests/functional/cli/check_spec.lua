-- `wsync check` on recipes with a model: the plan and the memory schedule,
-- as JSON and as text, and the errors of a recipe whose plan or schedule
-- cannot work (exit 3, file:line and the field or step). Checking starts
-- nothing: no process, no shared memory, no control socket.
local cjson = require("cjson")
local fixtures = require("tests.helpers.fixtures")
local leftovers = require("tests.helpers.leftovers")
local process = require("tests.helpers.process")
local recipe = require("wsync.recipe")

local RECIPES = fixtures.recipes

local function check(args)
  local result = leftovers.run(args, { timeout = 20000 })
  leftovers.assert_clean(result)
  -- Only the wsync process itself ran: it started nothing.
  assert.are.same({ [result.pid] = true }, result.pids)
  return result
end

describe("wsync check", function()
  it("prints the 30B FSDP4 -> TP4 plan as JSON", function()
    local result = check({ "check", "recipes/qwen3_30b_a3b_fsdp4_tp4.lua", "--plan-only", "--json" })
    assert.are.equal(0, result.code, result.stderr)
    assert.are.equal("", result.stderr)
    local summary = cjson.decode(result.stdout)
    assert.is_true(summary.ok)
    assert.are.equal("qwen3-30b-a3b-fsdp4-tp4", summary.recipe)
    assert.are.equal("qwen3_moe", summary.family)
    assert.are.equal(18867, summary.tensors)
    assert.are.equal(531, summary.trainer_tensors)
    assert.are.equal(61064245248, summary.bytes)
    assert.are.equal("model.layers.0.mlp.experts.gate_up_proj", summary.largest_tensor)
    assert.are.equal(805306368, summary.largest_tensor_bytes)
    assert.are.equal(1073741824, summary.buffer_bytes)
    assert.are.equal(2, summary.buffers)
    assert.is_number(summary.chunks)
    -- whole trainer tensors, at most 1 GiB each: at least bytes / 1 GiB chunks
    assert.is_true(summary.chunks >= math.ceil(61064245248 / 1073741824))
    assert.is_true(summary.chunks <= 531)
    assert.matches("^" .. string.rep("%x", 64) .. "$", summary.manifest)
    assert.are.equal(4, summary.trainer_ranks)
    assert.are.equal(4, summary.tp)
    assert.is_true(summary.peak_device_bytes <= summary.device_budget_bytes)
    assert.is_string(summary.peak_step)
  end)

  it("prints the plan as text: tensors, bytes, largest tensor, chunks, peak memory, manifest", function()
    local json = cjson.decode(check({ "check", "recipes/qwen3_30b_a3b_fsdp4_tp4.lua", "--plan-only", "--json" }).stdout)
    local result = check({ "check", "recipes/qwen3_30b_a3b_fsdp4_tp4.lua", "--plan-only" })
    assert.are.equal(0, result.code, result.stderr)
    local out = result.stdout
    assert.matches("^recipes/qwen3_30b_a3b_fsdp4_tp4.lua: plan ok: recipe qwen3%-30b%-a3b%-fsdp4%-tp4, "
      .. "backend cuda\n", out)
    assert.matches("\n  model +qwen3_moe %(qwen3%-30b%-a3b%), FSDP4 %-> TP4\n", out)
    assert.matches("\n  tensors +18867 canonical %(531 trainer tensors%)\n", out)
    assert.matches("\n  bytes +61064245248 %(56.87 GiB%)\n", out)
    assert.matches("\n  largest +model%.layers%.0%.mlp%.experts%.gate_up_proj, 805306368 bytes %(768%.00 MiB%)\n", out)
    assert.matches("\n  chunks +" .. json.chunks .. ", buffers 2 x 1073741824 bytes %(1%.00 GiB%)\n", out)
    assert.matches("\n  peak memory +" .. string.format("%d", json.peak_device_bytes)
      .. " bytes %([%d.]+ GiB%) per device, at ", out)
    assert.matches("\n  manifest +" .. json.manifest .. "\n", out)
    -- every schedule step with its bytes, the trainer rank's and vLLM's
    assert.matches("\n +schedule%[3%] +publish +%d+ %([%d.]+ GiB%) = [%d.]+ GiB %+ [%d.]+ GiB\n", out)
    assert.matches("\n +bootstrap%[1%] +sleep 1 +%d+ %(", out)
    assert.matches("\n  engine +vLLM reserves 22.40 GiB of the device's 140.00 GiB %(KV cache [%d.]+ GiB%)", out)
    -- and under --json, one entry per step of the bootstrap and the schedule
    local recipe_steps = require("wsync.recipe").load("recipes/qwen3_30b_a3b_fsdp4_tp4.lua")
    assert.are.equal(#recipe_steps.bootstrap + #recipe_steps.schedule, #json.memory_steps)
    for _, step in ipairs(json.memory_steps) do
      assert.is_string(step.where)
      if step.step ~= "publish" then -- (a publish's bytes are its peak: the buffers and a tensor in flight)
        assert.are.equal(step.bytes, step.trainer_bytes + step.rollout_bytes)
      end
    end
    assert.are.equal(math.floor(0.16 * 140 * 2 ^ 30), json.memory_model.reservation_bytes)
  end)

  it("plans a model that fits beside vLLM only by the schedule, and refuses it without the offload steps", function()
    local recipe_path = "tests/fixtures/recipes/colocated_4b.lua"
    local summary = cjson.decode(check({ "check", recipe_path, "--plan-only", "--json" }).stdout)
    assert.is_true(summary.peak_device_bytes <= summary.device_budget_bytes)
    -- (Trainer and vLLM together: at least 1.2 times the device; the issue's sizing.)
    local together = 0
    for _, step in ipairs(summary.memory_steps) do
      together = math.max(together, step.trainer_bytes)
    end
    together = together + summary.memory_model.reservation_bytes
    assert.is_true(together >= 1.2 * summary.device_budget_bytes, string.format("%d", together))
    local refused = check({ "check", recipe_path, "--plan-only",
      'schedule={ { wake = { "weights" } }, "publish", { wake = { "kv_cache" } }, "generate", { sleep = 2 } }' })
    assert.are.equal(3, refused.code)
    assert.matches("schedule%[3%] %(wake kv_cache%) needs %d+ bytes %([%d.]+ GiB%) on each device; the budget is "
      .. "150109880320 bytes %(139.80 GiB%): %d+ bytes %([%d.]+ GiB%) over", refused.stderr)
  end)

  it("says what vLLM holds of TP rank 0, and in FP8 (runtime.vllm.quantization) through either loader",
    function()
      local recipe_path = "recipes/qwen3_30b_a3b_fsdp4_tp4.lua"
      local words = { "check", recipe_path, "--plan-only", "runtime.vllm.quantization=fp8", "runtime.load=native" }
      local result = check(words)
      assert.are.equal(0, result.code, result.stderr)
      assert.matches("\n  rollout +TP rank 0 holds 675 tensors, [%d.]+ GiB %(quantization fp8%): bfloat16 195 tensors, "
        .. "[%d.]+ MiB; float32 240 tensors, [%d.]+ KiB; float8_e4m3fn 240 tensors, [%d.]+ GiB\n", result.stdout)
      words[#words + 1] = "--json"
      local summary = cjson.decode(check(words).stdout)
      assert.are.equal("fp8", summary.rollout_residents.quantization)
      assert.are.equal(240, summary.rollout_residents.by_dtype.float8_e4m3fn.tensors)
      local bf16 = cjson.decode(check({ "check", recipe_path, "--plan-only", "--json" }).stdout)
      assert.are.equal("none", bf16.rollout_residents.quantization)
      assert.are.equal(435, bf16.rollout_residents.tensors)
      -- (The direct loader quantizes as it copies; another quantization is
      -- refused, naming the field.)
      local direct = check({ "check", recipe_path, "--plan-only", "runtime.vllm.quantization=fp8",
        "runtime.check=never" })
      assert.are.equal(0, direct.code, direct.stderr)
      local checked = check({ "check", recipe_path, "--plan-only", "runtime.vllm.quantization=fp8",
        "runtime.check=every" })
      assert.are.equal(0, checked.code, checked.stderr)
      local refused = check({ "check", recipe_path, "--plan-only", "runtime.vllm.quantization=awq" })
      assert.are.equal(3, refused.code)
      assert.matches("quantization awq: wsync plans bfloat16 rollouts and \"fp8\"", refused.stderr, 1, true)
    end)

  it("--json is the same text on every run: keys sorted at every depth, with the wsync version and commit",
    function()
      local first = check({ "check", "recipes/demo.lua", "--json" })
      assert.are.equal(0, first.code, first.stderr)
      assert.are.equal(first.stdout, check({ "check", "recipes/demo.lua", "--json" }).stdout)
      assert.are.equal(require("wsync.util").json(cjson.decode(first.stdout)) .. "\n", first.stdout)
      -- (Keys in order, checked on the text itself: each object's keys as they come.)
      local keys = {}
      for key in first.stdout:gmatch('[{,]"([%w_]+)":') do
        keys[#keys + 1] = key
      end
      assert.are.equal("backend", keys[1])
      assert.are.equal("wsync", keys[#keys - 6]) -- (then the six keys of the build)
      local build = cjson.decode(first.stdout).wsync
      assert.are.same(require("wsync").build.version, build.version)
      assert.are.same({ "build_type", "commit", "cuda", "cuda_toolkit", "nccl", "version" },
        { unpack(keys, #keys - 5) })
    end)

  it("--json: a usage error and a recipe that cannot load are JSON objects on stdout, with their exit codes",
    function()
      for _, case in ipairs({
        { args = { "check", "--json" }, exit = 2, code = "USAGE", says = "wsync check needs a recipe file" },
        { args = { "check", "/nonexistent/recipe.lua", "--json" }, exit = 3, code = "RECIPE_INVALID",
          says = "cannot open the recipe" },
        { args = { "check", RECIPES .. "/syntax_error.lua", "--json" }, exit = 3, code = "RECIPE_INVALID",
          says = "syntax_error.lua:" },
      }) do
        local result = check(case.args)
        assert.are.equal(case.exit, result.code, result.stdout .. result.stderr)
        assert.are.equal("", result.stderr)
        local failure = cjson.decode(result.stdout)
        assert.is_false(failure.ok)
        assert.are.equal(case.exit, failure.exit_code)
        assert.are.equal(case.code, failure.error.code)
        assert.matches(case.says, failure.text, 1, true)
        assert.are.equal(require("wsync").version, failure.wsync.version)
      end
    end)

  it("checks the demo recipe", function()
    local result = check({ "check", "recipes/demo.lua", "--json" })
    assert.are.equal(0, result.code, result.stderr)
    local summary = cjson.decode(result.stdout)
    assert.are.equal(45, summary.tensors)
    assert.are.equal(405248, summary.bytes)
    assert.are.equal(3, summary.chunks)
    assert.are.equal(2, summary.tp)
    local text = check({ "check", "recipes/demo.lua" })
    assert.are.equal(0, text.code, text.stderr)
    assert.matches("tensors +45 canonical", text.stdout)
    assert.matches("manifest +" .. summary.manifest, text.stdout)
  end)

  it("exits 3 naming the tensor when the buffer is smaller than the largest tensor", function()
    local path = RECIPES .. "/publish_small_buffer.lua"
    local line = fixtures.bad_line(path)
    local result = check({ "check", path })
    assert.are.equal(3, result.code)
    assert.are.equal("", result.stdout)
    assert.are.equal(string.format("wsync: %s:%d: tensor model.embed_tokens.weight needs 128000 bytes (125.00 KiB) "
      .. "in one piece; the buffer holds 102400 (100.00 KiB): raise buffers.bytes\n", path, line), result.stderr)
  end)

  it("exits 3 naming the step, both byte counts and file:line when the schedule is over budget", function()
    local path = RECIPES .. "/publish_over_budget.lua"
    local line = fixtures.bad_line(path)
    local result = check({ "check", path })
    assert.are.equal(3, result.code)
    assert.are.equal("", result.stdout)
    assert.are.equal(string.format("wsync: %s:%d: schedule[5] (wake kv_cache) needs 1534272 bytes (1.46 MiB) on "
      .. "each device; the budget is 1468006 bytes (1.40 MiB): 66266 bytes (64.71 KiB) over (schedule[5] is "
      .. "inherited from recipes/demo.lua:%d)\n",
      path, line, recipe.field_line("recipes/demo.lua", "schedule")), result.stderr)
    -- With --json the same error is a JSON object on stdout, with the same
    -- exit code, and nothing on stderr.
    local json = check({ "check", path, "--json" })
    assert.are.equal(3, json.code)
    assert.are.equal("", json.stderr)
    local failure = cjson.decode(json.stdout)
    assert.is_false(failure.ok)
    assert.are.equal(3, failure.exit_code)
    assert.are.equal(result.stderr, "wsync: " .. failure.text .. "\n")
    assert.are.same({ code = "RECIPE_INVALID", file = path, line = line, field = "schedule[5]",
      message = failure.error.message }, failure.error)
    assert.matches("^schedule%[5%] %(wake kv_cache%) needs 1534272 bytes", failure.error.message)
    assert.are.equal(require("wsync").version, failure.wsync.version)
  end)

  it("exits 3 naming file:line and the field of a model config the plan refuses", function()
    local path = RECIPES .. "/publish_bad_model.lua"
    local line, field = fixtures.bad_line(path)
    local result = check({ "check", path })
    assert.are.equal(3, result.code)
    assert.are.equal("", result.stdout)
    assert.matches("^wsync: " .. path:gsub("%p", "%%%0") .. ":" .. line .. ": ", result.stderr)
    assert.matches(field .. " is not supported", result.stderr, 1, true)
  end)
end)

-- What `run` refuses before it starts, `check` refuses the same way: exit 3,
-- the same message at file:line, and neither starts a process.
describe("wsync check and wsync run agree", function()
  local function escape(text)
    return (text:gsub("%p", "%%%0"))
  end

  -- fixture, and a plain part of the message
  local REFUSED = {
    { "no_model.lua", "the recipe has nothing to run: it defines neither `run` nor `model`" },
    { "runtime_vllm.lua", "field 'runtime.model': the vllm runtime needs the directory of the model it serves" },
    { "publish_while_generating.lua", "schedule[1] (publish): publish while generation can run (the kv_cache is "
      .. "awake and generation is not paused)" },
    { "vllm_on_host.lua", "backend 'host': vLLM runs on the cuda backend (the vllm runtime on the host backend needs "
      .. "an engine in place of vLLM, named by $WSYNC_VLLM_ENGINE, as the tests do)" },
    { "vllm_no_config.lua", "runtime.model: tests/fixtures/recipes/../models/config.json cannot be read" },
    { "vllm_other_model.lua", "config.json says vocab_size = 151936; the recipe's model has 1000" },
    { "vllm_verify_synthetic.lua", "verify = true checks resident slices against wsync's synthetic values on the "
      .. "runtime's own storage; the vllm runtime checks verify = \"values\" (load = \"direct\") or nothing" },
    { "runtime_transformers.lua", "runtime.kind 'transformers' is not in this build (this build has: reference" },
    { "huge_buffer.lua", "field 'buffers.bytes': must be at most 9007199254740992 (2^53, the largest integer a Lua "
      .. "number holds exactly), got 1e+308" },
    { "too_many_ranks.lua", "field 'trainer.ranks': 100000 trainer ranks: the host backend has 64 devices" },
    { "ranks_not_tp.lua", "field 'runtime.tp': TP 1 differs from the 2 trainer ranks" },
    { "external_storage.lua", "field 'trainer': storage says how a synthetic trainer allocates its shards; an "
      .. "external trainer's tensors are its own (leave storage out)" },
    { "shm_too_small.lua", "the packed buffers take 70368744177664 bytes (64.00 TiB) of /dev/shm (2 trainer ranks x 2 "
      .. "buffers x 17592186044416 bytes); it has " },
    { "kv_too_large.lua", "on the host backend every device is this machine's memory: the run holds 35184373562624 "
      .. "bytes (32.00 TiB: packed buffers 655360, trainer shards 405248, resident weights of 2 TP workers 413184, KV "
      .. "arenas of 2 TP workers 35184372088832); the machine has " },
    { "model_too_many_layers.lua", "the config makes 21000003 canonical tensors (1000000 layers x 21 per layer); a "
      .. "plan holds at most 1048576" },
  }

  for _, case in ipairs(REFUSED) do
    local file, says = case[1], case[2]
    it(file .. ": both exit 3 at file:line before anything starts", function()
      local path = RECIPES .. "/" .. file
      local line = fixtures.bad_line(path)
      local checked = check({ "check", path })
      assert.are.equal(3, checked.code, checked.stderr)
      assert.are.equal("", checked.stdout)
      assert.matches("^wsync: " .. escape(path) .. ":" .. line .. ": [^\n]+\n$", checked.stderr)
      assert.matches(says, checked.stderr, 1, true)
      assert.is_nil(checked.stderr:find("-9223372036854775808", 1, true))
      local ran = check({ "run", path })
      assert.are.equal(3, ran.code, ran.stderr)
      assert.are.equal("", ran.stdout)
      assert.are.equal(checked.stderr, ran.stderr)
    end)
  end

  it("a cuda recipe: check and run refuse it alike; check --plan-only shows its plan and says why not", function()
    local path = RECIPES .. "/backend_cuda.lua"
    local line = fixtures.bad_line(path)
    -- (This build may have cuda; this machine has no GPU: either is why.)
    local json_first = cjson.decode(check({ "check", path, "--plan-only", "--json" }).stdout)
    local says = json_first.not_runnable
    assert.matches("^backend 'cuda': ", says)
    -- In plain words (CUDA's own error name after them), and refused with a
    -- pointer to --plan-only.
    assert.is_truthy(says:find("this wsync was built without CUDA", 1, true)
      or says:find("this machine has no usable GPU", 1, true), says)
    local refused = string.format("wsync: %s:%d: %s; `wsync check --plan-only` checks its plan and schedule without "
      .. "running it\n", path, line, says)
    local checked = check({ "check", path })
    assert.are.equal(3, checked.code, checked.stderr)
    assert.are.equal("", checked.stdout)
    assert.are.equal(refused, checked.stderr)
    local json = check({ "check", path, "--plan-only", "--json" })
    assert.are.equal(0, json.code, json.stderr)
    local summary = cjson.decode(json.stdout)
    assert.is_false(summary.runs_here)
    assert.are.equal(says, summary.not_runnable)
    assert.are.equal(3, summary.chunks)
    local text = check({ "check", path, "--plan-only" })
    assert.are.equal(0, text.code, text.stderr)
    assert.matches(": plan ok: recipe ", text.stdout, 1, true)
    assert.matches("\n  runs here    no: " .. says .. "; `wsync run` refuses it\n", text.stdout, 1, true)
    local ran = check({ "run", path })
    assert.are.equal(3, ran.code, ran.stderr)
    assert.are.equal("", ran.stdout)
    assert.are.equal(refused, ran.stderr)
  end)

  it("the 30B recipe: check refuses it without four GPUs and vLLM; its plan checks with --plan-only", function()
    local refused = check({ "check", "recipes/qwen3_30b_a3b_fsdp4_tp4.lua" })
    assert.are.equal(3, refused.code)
    local summary = cjson.decode(check({ "check", "recipes/qwen3_30b_a3b_fsdp4_tp4.lua", "--plan-only",
      "--json" }).stdout)
    assert.is_false(summary.runs_here)
    -- (No GPU here, or fewer than four, or no vLLM: whichever comes first.)
    assert.matches(summary.not_runnable, refused.stderr, 1, true)
    assert.are.same({ kind = "vllm", tp = 4, replicas = 1, load = "direct", channel = "socket",
      model = "recipes/models/qwen3-30b-a3b" }, summary.runtime)
    local text = check({ "check", "recipes/qwen3_30b_a3b_fsdp4_tp4.lua", "--plan-only" }).stdout
    assert.matches("\n  runtime      vllm TP4, load direct over wsync's socket, model recipes/models/qwen3-30b-a3b\n",
      text, 1, true)
    text = check({ "check", RECIPES .. "/vllm_30b_bench.lua", "runtime.channel=rpc", "--plan-only" }).stdout
    assert.matches("\n  runtime      vllm TP1, load direct through vLLM's collective_rpc, model ", text, 1, true)
    assert.is_true(cjson.decode(check({ "check", "recipes/demo.lua", "--json" }).stdout).runs_here)
  end)

  it("the RL example's recipes: grpo_tiny_cpu.lua runs here, grpo_tiny.lua (vLLM) checks with --plan-only", function()
    -- (tests/python/test_example.py runs the first; the GPU tier's example stage the second.)
    local cpu = cjson.decode(check({ "check", "recipes/grpo_tiny_cpu.lua", "--json" }).stdout)
    assert.is_true(cpu.runs_here)
    assert.are.same({ kind = "reference", tp = 1, replicas = 1 }, cpu.runtime)
    local gpu = cjson.decode(check({ "check", "recipes/grpo_tiny.lua", "--plan-only", "--json" }).stdout)
    assert.is_true(gpu.ok)
    assert.are.same({ "cuda", 1, 0 }, { gpu.backend, gpu.chunks, gpu.buffer_bytes }) -- the direct path
    assert.are.same({ kind = "vllm", tp = 1, replicas = 1, load = "direct", channel = "socket",
      model = "recipes/models/qwen3-moe-small" }, gpu.runtime)
    assert.are.equal(cpu.manifest, gpu.manifest) -- the same model
  end)

  -- `command` (check or run) of the demo under a shell's `ulimit` option;
  -- `limit` is shell arithmetic, where $open is the number of files the shell
  -- has open (and passes on).
  local function under_ulimit(option, limit, command)
    return process.run({
      program = "/bin/bash",
      args = { "-c", string.format('open=$(ls /proc/$$/fd | wc -l); ulimit %s $((%s)) && exec "$0" "$@"', option,
        limit), process.wsync_binary(), command, "recipes/demo.lua" },
      timeout = 60000,
    })
  end

  local ranks_line = recipe.field_line("recipes/demo.lua", "trainer.ranks")

  it("refuses a run that needs more open files than RLIMIT_NOFILE allows, as run does before it starts", function()
    -- wsync itself opens 6 (the loop's) before it checks: $open + 9 lets it
    -- start, and the run needs more.
    local checked = under_ulimit("-n", "open + 9", "check")
    assert.are.equal(3, checked.code, checked.stderr)
    assert.are.equal("", checked.stdout)
    assert.matches("^wsync: recipes/demo%.lua:" .. ranks_line .. ": the host process needs at least %d+ open files "
      .. "for 2 trainer ranks %(%d+ open now, one per rank, 5 for the endpoint, the runtime and the loop%); "
      .. "RLIMIT_NOFILE %(ulimit %-n%) allows %d+\n$", checked.stderr)
    local needed, limit = checked.stderr:match("needs at least (%d+) .* allows (%d+)\n$")
    assert.is_true(tonumber(needed) > tonumber(limit))
    local ran = under_ulimit("-n", "open + 9", "run")
    assert.are.equal(3, ran.code, ran.stderr)
    assert.are.equal("", ran.stdout) -- no session opened: nothing started
    -- The same refusal; its counts are of files open in each process, and
    -- what a child inherits from this runner may differ by a pipe whose
    -- close is still pending in its loop.
    local function counts_out(text)
      return (text:gsub("%d+ open files", "N open files"):gsub("%(%d+ open now", "(N open now")
        :gsub("allows %d+", "allows N"))
    end
    assert.are.equal(counts_out(checked.stderr), counts_out(ran.stderr))
    -- with room for the run's files, it checks
    local roomy = under_ulimit("-n", "open + 20", "check")
    assert.are.equal(0, roomy.code, roomy.stderr)
  end)

  it("refuses a run that starts more processes than RLIMIT_NPROC allows (root is not held to it)", function()
    local checked = under_ulimit("-u", "3", "check")
    local status = io.open("/proc/self/status"):read("*a")
    if status:match("\nUid:%s+(%d+)") == "0" then
      assert.are.equal(0, checked.code, checked.stderr)
      return
    end
    assert.are.equal(3, checked.code, checked.stderr)
    assert.are.equal(string.format("wsync: recipes/demo.lua:%d: the run starts 5 processes (2 synthetic trainer "
      .. "ranks, the runtime's main process, 2 TP workers); RLIMIT_NPROC (ulimit -u) allows this user 3\n",
      ranks_line), checked.stderr)
    local ran = under_ulimit("-u", "3", "run")
    assert.are.equal(3, ran.code, ran.stderr)
    assert.are.equal(checked.stderr, ran.stderr)
  end)
end)
