-- `wsync check` on recipes with a model: the plan and the memory schedule,
-- as JSON and as text, and the errors of a recipe whose plan or schedule
-- cannot work (exit 3, file:line and the field or step). Checking starts
-- nothing: no process, no shared memory, no control socket.
local cjson = require("cjson")
local fixtures = require("tests.helpers.fixtures")
local leftovers = require("tests.helpers.leftovers")
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
    local result = check({ "check", "recipes/qwen3_30b_a3b_fsdp4_tp4.lua", "--json" })
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
    local json = cjson.decode(check({ "check", "recipes/qwen3_30b_a3b_fsdp4_tp4.lua", "--json" }).stdout)
    local result = check({ "check", "recipes/qwen3_30b_a3b_fsdp4_tp4.lua" })
    assert.are.equal(0, result.code, result.stderr)
    local out = result.stdout
    assert.matches("^recipes/qwen3_30b_a3b_fsdp4_tp4.lua: ok: recipe qwen3%-30b%-a3b%-fsdp4%-tp4, backend cuda\n", out)
    assert.matches("\n  model +qwen3_moe %(qwen3%-30b%-a3b%), FSDP4 %-> TP4\n", out)
    assert.matches("\n  tensors +18867 canonical %(531 trainer tensors%)\n", out)
    assert.matches("\n  bytes +61064245248 %(56.87 GiB%)\n", out)
    assert.matches("\n  largest +model%.layers%.0%.mlp%.experts%.gate_up_proj, 805306368 bytes %(768%.00 MiB%)\n", out)
    assert.matches("\n  chunks +" .. json.chunks .. ", buffers 2 x 1073741824 bytes %(1%.00 GiB%)\n", out)
    assert.matches("\n  peak memory +" .. string.format("%d", json.peak_device_bytes) .. " bytes %([%d.]+ GiB%) per device, at ",
      out)
    assert.matches("\n  manifest +" .. json.manifest .. "\n", out)
    -- every schedule step with its bytes
    assert.matches("\n +schedule%[3%] +publish +%d+ %(", out)
    assert.matches("\n +bootstrap%[1%] +sleep 1 +%d+ %(", out)
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
    assert.are.equal(string.format("wsync: %s:%d: tensor model.embed_tokens.weight needs 128000 bytes (125.00 KiB); "
      .. "the buffer holds 102400 (100.00 KiB): raise buffers.bytes\n", path, line), result.stderr)
  end)

  it("exits 3 naming the step, both byte counts and file:line when the schedule is over budget", function()
    local path = RECIPES .. "/publish_over_budget.lua"
    local line = fixtures.bad_line(path)
    local result = check({ "check", path, "--json" })
    assert.are.equal(3, result.code)
    assert.are.equal("", result.stdout)
    assert.are.equal(string.format("wsync: %s:%d: schedule[5] (wake kv_cache) needs 1534272 bytes (1.46 MiB) on "
      .. "each device; the budget is 1468006 bytes (1.40 MiB) (schedule[5] is inherited from recipes/demo.lua:%d)\n",
      path, line, recipe.field_line("recipes/demo.lua", "schedule")), result.stderr)
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
