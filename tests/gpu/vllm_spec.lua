-- Real vLLM 0.26 behind the vllm runtime, on the GPU machine with the vLLM
-- bundle sourced (`. .vllm/activate.sh`): the trainer's parameters published
-- into vLLM give vLLM's log-probabilities the trainer's own, in both load
-- modes (tests/gpu/vllm_e2e.py), and failed publications leave nothing
-- (tests/gpu/vllm_faults.py); and first, without vLLM, its direct loader
-- over CUDA IPC into parameters in device memory (an engine in place of vLLM,
-- tests/python/vllm_stand_in.py). Pending without a usable device, torch or
-- vLLM importable by python3 (as in CI).
local process = require("tests.helpers.process")
local support = require("tests.gpu.support")

local count, reason = support.devices()

-- Why python3 cannot run vLLM here, or nil (without importing it: 15-25 s).
local function no_vllm()
  local result = process.run({ program = "python3", args = { "-c",
    "import importlib.util as u, sys; sys.exit(0 if u.find_spec('vllm') and u.find_spec('torch') "
    .. "and u.find_spec('wsync.vllm') else 3)" }, timeout = 60000 })
  if result.code ~= 0 then
    return "python3 finds no vllm, torch or wsync.vllm (source the vLLM bundle's activate.sh and the wsync "
      .. "bundle's env.sh)"
  end
  return nil
end

describe("the vllm runtime's direct loader on cuda (an engine in place of vLLM, its parameters torch's)", function()
  if count == 0 then
    pending("no CUDA device: " .. reason)
    return
  end
  local torch = process.run({ program = "python3", args = { "-c",
    "import importlib.util as u, sys; sys.exit(0 if u.find_spec('torch') else 3)" }, timeout = 60000 })
  if torch.code ~= 0 then
    pending("python3 finds no torch")
    return
  end
  local leftovers = require("tests.helpers.leftovers")
  local path = os.getenv("PYTHONPATH")
  local env = { "WSYNC_VLLM_ENGINE=vllm_stand_in:Engine",
    "PYTHONPATH=tests/python" .. (path and path ~= "" and (":" .. path) or "") }

  it("publishes three versions into parameters in device memory, each checked against the trainer's values",
    function()
      local result = leftovers.run({ "run", "tests/fixtures/recipes/vllm_stand_in_cuda.lua" }, { env = env,
        timeout = 120000 })
      leftovers.assert_clean(result)
      assert.are.equal(0, result.code, result.stdout .. result.stderr)
      local _, verified = result.stdout:gsub("resident weights verified", "")
      assert.are.equal(3, verified, result.stdout)
    end)

  it("fails the values check when a parameter in device memory was changed after its load", function()
    env[#env + 1] = "WSYNC_STAND_IN_FAULT=finish:corrupt"
    local result = leftovers.run({ "run", "tests/fixtures/recipes/vllm_stand_in_cuda.lua" }, { env = env,
      timeout = 120000 })
    env[#env] = nil
    leftovers.assert_clean(result)
    assert.are_not.equal(0, result.code)
    assert.matches("TP worker 0 holds model.layers.0.self_attn.qkv_proj.weight with values sum", result.stdout, 1,
      true)
  end)
end)

-- (#vllm: tests/gpu/run.sh's tier stage leaves these to its vllm stage, which runs them
-- in a device call of their own.)
describe("the vllm runtime with vLLM #vllm", function()
  if count == 0 then
    pending("no CUDA device: " .. reason)
    return
  end
  local missing = no_vllm()
  if missing then
    pending(missing)
    return
  end

  local function script(args, timeout)
    local result = process.run({ program = "python3", args = args, timeout = timeout })
    io.stdout:write(result.stdout, result.stderr)
    return result
  end

  -- (direct-sleep: level 1 at bootstrap, level 2 before each publication. The FP8
  -- rollouts, vLLM's online FP8 of the trainer's bfloat16 quantized by wsync's direct
  -- loader, checked against vLLM's own in every publication, or by vLLM's own loader, are
  -- #fp8: about three minutes more, which the vllm stage's device call has not left;
  -- tests/gpu/run.sh runs them as the vllm-fp8 stage.)
  for _, load in ipairs({ "direct", "native", "direct-sleep", "direct-fp8", "native-fp8" }) do
    local fp8 = load:find("fp8", 1, true) ~= nil
    it(fp8 and "publishes into vLLM in FP8, its log-probabilities within what FP8 weights explain (" .. load
      .. ") #fp8" or "publishes a trainer's steps into vLLM whose log-probabilities then follow the trainer's ("
      .. load .. ")", function()
        local result = script({ "tests/gpu/vllm_e2e.py", "--load", load }, 420000)
        assert.are.equal(0, result.code, result.stderr)
        assert.matches("vllm_e2e: ok (" .. load, result.stdout, 1, true)
      end)
  end

  it("keeps generating across publications in keep mode, each token stamped with its version", function()
    local result = script({ "tests/gpu/vllm_keep.py" }, 300000)
    assert.are.equal(0, result.code, result.stderr)
    assert.matches("vllm_keep: ok", result.stdout, 1, true)
  end)

  -- (Seven vLLM engines, one per case: about seven minutes, a device call of its own;
  -- tests/gpu/run.sh runs it as the vllm-faults stage.)
  it("leaves nothing when vLLM's engine, the runtime or the trainer dies or stops, or a receipt is wrong #faults",
    function()
      local result = script({ "tests/gpu/vllm_faults.py" }, 590000)
      assert.are.equal(0, result.code, result.stderr)
      assert.matches("vllm_faults: ok", result.stdout, 1, true)
    end)
end)
