-- Publications on the cuda backend, on one GPU (trainer world 1, TP1): the
-- demo (recipes/demo_cuda.lua), the full Qwen3-30B-A3B shape with every
-- resident slice checked on the device, both also with their chunks ordered
-- on the device, a runtime killed mid-chunk and mid-finish and a trainer
-- killed mid-fill, host- and device-ordered (each poisoning cleanly, device
-- memory back at its baseline), and 100 publications in a row with device
-- memory and host memory flat. Pending without a usable device.
local async = require("tests.helpers.async")
local leftovers = require("tests.helpers.leftovers")
local soak = require("tests.helpers.soak")
local support = require("tests.gpu.support")

local count, reason = support.devices()

local MiB = 1024 * 1024
-- What another process's exit may leave of the device's memory for a moment.
local SLACK = 64 * MiB

local function verdict(stdout)
  return stdout:match("\nwsync: verdict: ([^\n]*)\n")
end

-- Runs `wsync run RECIPE` with `env`; checks that nothing is left and that
-- the device's free memory is back at its baseline. Returns the result.
local function run(recipe, env, timeout)
  local baseline = support.free_bytes(0)
  local result = leftovers.run({ "run", recipe }, { env = env, timeout = timeout or 120000 })
  leftovers.assert_clean(result)
  local after = support.free_bytes(0)
  assert.is_true(after >= baseline - SLACK, string.format("device memory not back: %d bytes free before, %d after",
    baseline, after))
  return result
end

describe("publication on the cuda backend", function()
  if count == 0 then
    pending("no CUDA device: " .. reason)
    return
  end

  it("runs the demo on one GPU: three versions, every resident slice checked on the device", function()
    local result = run("recipes/demo_cuda.lua")
    assert.are.equal(0, result.code, result.stdout .. result.stderr)
    assert.matches("^OK: 3 model versions published", verdict(result.stdout))
    local checked = 0
    local pattern = "resident weights verified on the device %(%d+ slices, %d+ elements on 1 workers%)"
    for _ in result.stdout:gmatch(pattern) do
      checked = checked + 1
    end
    assert.are.equal(3, checked, result.stdout)
  end)

  it("checks the demo on one GPU against the trainer's values (read back from the device)", function()
    local result = run("tests/fixtures/recipes/cuda_values.lua")
    assert.are.equal(0, result.code, result.stdout .. result.stderr)
    assert.matches("^OK: 3 model versions published, every resident TP slice verified against the trainer's values",
      verdict(result.stdout))
  end)

  for _, recipe in ipairs({ "cuda_fp8.lua", "cuda_fp8_direct.lua" }) do
    it("quantizes the demo to FP8 on the device (" .. recipe .. "), every resident tensor checked bitwise against "
      .. "the host's quantization", function()
      local result = run("tests/fixtures/recipes/" .. recipe)
      assert.are.equal(0, result.code, result.stdout .. result.stderr)
      assert.are.equal("OK: 3 model versions published, every resident TP slice verified", verdict(result.stdout))
      assert.matches(", 31 resident tensors, manifest", result.stdout, 1, true)
    end)
  end

  it("publishes the full Qwen3-30B-A3B shape, every resident slice checked on the device", function()
    local result = run("tests/fixtures/recipes/cuda_30b.lua", nil, 300000)
    io.stderr:write("\n", result.stdout:match("(wsync: closing report.-)\nwsync: verdict") or result.stdout, "\n")
    assert.are.equal(0, result.code, result.stdout .. result.stderr)
    assert.matches("^OK: 3 model versions published", verdict(result.stdout))
    -- Every element of the 30,532,122,624 parameters, once in its TP1 slice.
    local elements = tonumber(result.stdout:match("verified on the device %(%d+ slices, (%d+) elements"))
    assert.are.equal(30532122624, elements)
  end)

  for _, case in ipairs({ { recipe = "cuda_30b_direct.lua", storage = "one allocation" },
    { recipe = "cuda_30b_direct_tensors.lua", storage = "one allocation per tensor" } }) do
    it("publishes the 30B-A3B shape on the direct path (no packed buffers) from " .. case.storage
      .. ", every slice checked", function()
      local result = run("tests/fixtures/recipes/" .. case.recipe, nil, 300000)
      io.stderr:write("\n", result.stdout:match("(wsync: closing report.-)\nwsync: verdict") or result.stdout, "\n")
      assert.are.equal(0, result.code, result.stdout .. result.stderr)
      assert.matches("^OK: 3 model versions published", verdict(result.stdout))
      assert.matches("in 1 chunks (direct", result.stdout, 1, true)
      local elements = tonumber(result.stdout:match("verified on the device %(%d+ slices, (%d+) elements"))
      assert.are.equal(30532122624, elements)
    end)
  end

  it("orders the demo's chunks on the device (buffers.order = \"device\"), every resident slice checked", function()
    local result = run("tests/fixtures/recipes/cuda_ordered.lua")
    assert.are.equal(0, result.code, result.stdout .. result.stderr)
    assert.matches("^OK: 3 model versions published", verdict(result.stdout))
  end)

  it("orders the 30B-A3B shape's chunks on the device through one 4 GiB buffer, every slice checked", function()
    local result = run("tests/fixtures/recipes/cuda_30b_ordered.lua", nil, 300000)
    io.stderr:write("\n", result.stdout:match("(wsync: closing report.-)\nwsync: verdict") or result.stdout, "\n")
    assert.are.equal(0, result.code, result.stdout .. result.stderr)
    assert.matches("^OK: 3 model versions published", verdict(result.stdout))
    local elements = tonumber(result.stdout:match("verified on the device %(%d+ slices, (%d+) elements"))
    assert.are.equal(30532122624, elements)
  end)

  for _, recipe in ipairs({ "recipes/demo_cuda.lua", "tests/fixtures/recipes/cuda_ordered.lua" }) do
    for _, case in ipairs({
      { env = "WSYNC_RUNTIME_FAULT=worker0:crash@load_chunk#2", says = "TP worker 0", phase = "chunks" },
      -- (A TP worker finishes its update with its last load_chunk.)
      { env = "WSYNC_RUNTIME_FAULT=worker0:crash@finish_update", says = "TP worker 0", phase = "chunks" },
      { env = "WSYNC_RUNTIME_FAULT=crash@finish_update", says = "reference runtime", phase = "finish" },
      { env = "WSYNC_TRAINER_FAULT=rank0:die@fill#2", says = "trainer rank 0", phase = "chunks" },
    }) do
      it(recipe .. ", " .. case.env .. ": poisons cleanly, nothing committed, device memory back at its baseline",
        function()
          local result = run(recipe, { case.env })
          assert.are.equal(1, result.code, result.stdout .. result.stderr)
          local failure = verdict(result.stdout):match("^FAILED: (.*)$")
          assert.matches("^%[phase " .. case.phase, failure)
          assert.matches(case.says, failure, 1, true)
          assert.is_nil(result.stdout:find("\nwsync: published model version", 1, true))
        end)
    end
  end

  it("keeps device memory and the Lua heaps flat over 100 publications", function()
    local samples
    async.run_async(function()
      -- (Warm-up past the reports a session keeps: wsync.publish.session.KEPT_REPORTS.)
      samples = soak.run({ publications = 140, warmup = 40, every = 50, recipe = "recipes/demo_cuda.lua",
        verify = true })
    end, 300000)
    local first, last = samples[1].processes[1].usage, samples[#samples].processes[1].usage
    assert.is_number(first.device_free_bytes)
    assert.is_true(last.device_free_bytes >= first.device_free_bytes - SLACK, string.format(
      "device free memory fell from %d to %d bytes", first.device_free_bytes, last.device_free_bytes))
    for role, grown in pairs(soak.growth(samples)) do
      assert.is_true(grown.heap <= 64 * 1024, string.format("%s: heap grew by %d bytes", role, grown.heap))
      assert.is_true(grown.rss <= 16 * MiB, string.format("%s: RSS grew by %d bytes", role, grown.rss))
    end
  end)
end)
