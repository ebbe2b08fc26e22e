-- wsync.recipe.serve: what this build and this machine can serve, refused
-- before anything starts, naming the recipe's field.
local uv = require("luv")
local fields = require("wsync.recipe.fields")
local load_module = require("wsync.recipe.load")
local location = require("wsync.recipe.location")
local prepare = require("wsync.recipe.prepare")
local schema = require("wsync.recipe.schema")
local serve = require("wsync.recipe.serve")
local fixtures = require("tests.helpers.fixtures")
local recipes = require("tests.helpers.recipes")

local error_of = require("tests.helpers.errors").error_of
local model_recipe = recipes.model

describe("unserved", function()
  local function validated(changes)
    return assert(schema.check(fields.schema, model_recipe(changes)))
  end

  it("serves the reference runtime on the host backend", function()
    assert.is_nil(serve.unserved(validated()))
  end)

  it("names runtime.kind and what this build has for the runtimes it lacks", function()
    local message, field = serve.unserved(validated({ runtime = { kind = "transformers" } }))
    assert.are.equal("runtime.kind", field)
    local backends = require("wsync").cuda_built and "cuda and host" or "host"
    assert.are.equal("runtime.kind 'transformers' is not in this build (this build has: reference, on the "
      .. backends .. " backend; vllm, on the " .. backends .. " backend)", message)
  end)

  it("refuses the vllm runtime on the host backend without an engine in place of vLLM", function()
    local unavailable = require("wsync.runtime.vllm").unavailable
    local validated_recipe = validated({ runtime = { kind = "vllm", model = "tests/fixtures/models/tiny" } })
    local saved = os.getenv
    os.getenv = function(name) -- luacheck: ignore 122 (this process's view of the variable)
      if name == "WSYNC_VLLM_ENGINE" then
        return nil
      end
      return saved(name)
    end
    local ok, message, field = pcall(unavailable, validated_recipe)
    os.getenv = saved -- luacheck: ignore 122
    assert.is_true(ok, message)
    assert.are.equal("backend", field)
    assert.matches("^backend 'host': vLLM runs on the cuda backend", message)
  end)

  it("names the backend that the reference runtime's workers cannot hold weights on in this build", function()
    local message, field = serve.unserved(validated({ backend = "cuda" }))
    if require("wsync").cuda_built then
      -- (Built with cuda: refused here only when this machine has no GPU.)
      local count = require("wsync.native.device").count("cuda")
      if count and count > 0 then
        assert.is_nil(message)
      else
        assert.are.equal("backend", field)
        assert.matches("^backend 'cuda': this machine has no usable GPU", message)
      end
      return
    end
    assert.are.equal("backend", field)
    assert.are.equal("backend 'cuda': this build's reference runtime holds weights on the host backend only", message)
  end)

  it("says plainly why the cuda backend cannot run here, CUDA's own words after", function()
    local build = require("wsync").build
    local cuda, toolkit = build.cuda, build.cuda_toolkit
    build.cuda, build.cuda_toolkit = true, "13.0.88"
    local reasons = {
      serve.no_gpu("cuda backend: cudaGetDeviceCount: cudaErrorInsufficientDriver (CUDA driver version is "
        .. "insufficient for CUDA runtime version)"),
      serve.no_gpu("cuda backend: cudaGetDeviceCount: cudaErrorNoDevice (no CUDA-capable device is detected)"),
      serve.no_gpu(nil),
    }
    build.cuda = false
    reasons[4] = serve.no_gpu("nccl: this wsync was built without CUDA")
    build.cuda, build.cuda_toolkit = cuda, toolkit
    assert.are.same({
      "backend 'cuda': this machine has no usable GPU: no NVIDIA driver is loaded, or one too old for the CUDA "
        .. "13.0.88 runtime this wsync was built with (CUDA says cudaErrorInsufficientDriver)",
      "backend 'cuda': this machine has no usable GPU: the NVIDIA driver sees no GPU (CUDA_VISIBLE_DEVICES may hide "
        .. "them) (CUDA says cudaErrorNoDevice)",
      "backend 'cuda': this machine has no usable GPU (the CUDA runtime sees 0 devices)",
      "backend 'cuda': this wsync was built without CUDA (no CUDA toolkit when it was built): it runs the host "
        .. "backend only",
    }, reasons)
  end)

  it("refuses the cuda backend where no CUDA device is usable, naming the backend", function()
    local count = require("wsync.native.device").count("cuda")
    if count and count > 0 then
      pending("this machine has a CUDA device")
      return
    end
    local err = error_of(prepare.check, load_module.load(fixtures.recipes .. "/backend_cuda.lua"))
    assert.are.equal("backend", err.field)
    assert.matches("^backend 'cuda': ", err.message)
  end)

  it("names a generate step of a runtime that does not generate", function()
    local schedule = { { wake = { "weights" } }, "publish", { wake = { "kv_cache" } }, "generate" }
    assert.is_nil(serve.unserved(validated({ schedule = schedule })), "the reference runtime's toy decoder serves it")
    local saved = serve.RUNTIMES.reference.generates
    serve.RUNTIMES.reference.generates = false
    local message, field = serve.unserved(validated({ schedule = schedule }))
    serve.RUNTIMES.reference.generates = saved
    assert.are.equal("schedule[4]", field)
    assert.are.equal("schedule[4] (generate): the reference runtime does not generate text", message)
  end)
end)

describe("check_serve", function()
  it("passes the demo on the host backend", function()
    assert.is_nil(serve.check_serve(load_module.load("recipes/demo.lua")))
  end)

  it("refuses a unix socket path longer than a socket takes, naming control.endpoint", function()
    local path = "/tmp/" .. string.rep("s", 120)
    local err = error_of(serve.check_serve, load_module.load("recipes/demo.lua", { ["control.endpoint"] = path }))
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.are.equal("control.endpoint", err.field)
    assert.are.equal(string.format("%s is 125 bytes; a unix socket's path takes at most %d (set on the command line: "
      .. "control.endpoint=%s)", path, require("wsync.control.endpoint").MAX_SOCKET_PATH, path), err.message)
  end)

  it("refuses a TCP endpoint whose token is not where the recipe says, naming the field", function()
    local err = error_of(serve.check_serve, load_module.load("recipes/demo.lua", { ["control.tcp"] = "127.0.0.1:0",
      ["control.token_env"] = "WSYNC_SPEC_NO_SUCH_TOKEN" }))
    assert.are.equal("control.token_env", err.field)
    assert.matches("^the environment variable WSYNC_SPEC_NO_SUCH_TOKEN, which holds the TCP endpoint's token, is not "
      .. "set", err.message)
  end)
end)

describe("check_machine", function()
  local PLAN = { buffer_count = 2, buffer_bytes = 1024, bytes = 4096 }
  local TOPOLOGY = { world = 2, tp = 2 }

  it("leaves a cuda recipe's device bytes to the preflight", function()
    assert.is_nil(serve.check_machine(recipes.validated({ backend = "cuda" }), PLAN, TOPOLOGY,
      { sizes = { buffers = 2 ^ 52, rollout = 2 ^ 52, kv_cache = 2 ^ 52 } }))
  end)

  it("refuses a run that holds more than this machine's memory, naming its largest part", function()
    local recipe = load_module.load("recipes/demo.lua")
    local err = error_of(serve.check_machine, recipe, PLAN, TOPOLOGY,
      { sizes = { buffers = 2048, rollout = 4096, kv_cache = 2 ^ 52 } })
    assert.are.equal("memory.kv_bytes", err.field)
    assert.are.equal(location.field_line("recipes/demo.lua", "memory.kv_bytes"), err.line)
    assert.matches("^on the host backend every device is this machine's memory: the run holds %d+ bytes %(.-: "
      .. "packed buffers 4096, trainer shards 4096, resident weights of 2 TP workers 8192, KV arenas of 2 TP "
      .. "workers 9007199254740992%); the machine has ", err.message)
  end)

  it("refuses packed buffers beyond the free space of /dev/shm, naming buffers.bytes", function()
    if not (uv.fs_statfs and uv.fs_statfs("/dev/shm")) then
      pending("no /dev/shm here")
      return
    end
    local err = error_of(serve.check_machine, load_module.load("recipes/demo.lua"), PLAN, TOPOLOGY,
      { sizes = { buffers = 2 ^ 52, rollout = 0, kv_cache = 0 } })
    assert.are.equal("buffers.bytes", err.field)
    assert.matches("^the packed buffers take 9007199254740992 bytes %(.-%) of /dev/shm %(2 trainer ranks x 2 "
      .. "buffers x 1024 bytes%); it has %d+ bytes", err.message)
  end)
end)
