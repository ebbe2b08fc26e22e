-- `wsync run` and `wsync check`: recipes from the command line.
local cjson = require("cjson")
local ffi = require("ffi")
local C = require("wsync.native.ffi")
local process = require("tests.helpers.process")
local fixtures = require("tests.helpers.fixtures")
local shm_files = require("tests.helpers.shm")
local core = require("tests.helpers.core_manifest")

-- Runs wsync and also returns the child's process id.
local function run_with_pid(args)
  local child_pid = nil
  local result = process.run({
    args = args,
    on_start = function(_, stdin, pid)
      child_pid = pid
      stdin:shutdown(function()
        stdin:close()
      end)
    end,
  })
  return result, child_pid
end

local function host_uuid(index)
  local info = ffi.new("ws_device_info")
  assert(C.ws_device_query(C.WS_BACKEND_HOST, index, info) == 0)
  return ffi.string(info.uuid)
end

local function lines(text)
  local result = {}
  for line in text:gmatch("([^\n]*)\n") do
    result[#result + 1] = line
  end
  return result
end

describe("wsync run", function()
  it("runs recipes/smoke.lua and leaves no shared memory behind", function()
    local result, pid = run_with_pid({ "run", "recipes/smoke.lua" })
    assert.are.equal(0, result.code, result.stderr)
    assert.are.equal("", result.stderr)
    local digest = core.digest({
      { "model.embed_tokens.weight", "bfloat16", { 1024, 64 } },
      { "model.layers.0.self_attn.q_proj.weight", "bfloat16", { 128, 64 } },
      { "model.norm.weight", "bfloat16", { 64 } },
    })
    assert.are.same({
      "smoke: hello from the smoke recipe",
      "smoke: manifest " .. digest .. " (3 records, 147584 bytes)",
      "smoke: shared memory round-trip ok (1048576 bytes)",
      "smoke: rank 0 -> host device " .. host_uuid(0),
      "smoke: rank 1 -> host device " .. host_uuid(1),
      "smoke: ok",
    }, lines(result.stdout))
    assert.is_number(pid)
    assert.are.same({}, shm_files.segments(pid))
  end)

  it("applies key=value overrides with the parameters' types", function()
    local result = process.wsync({ "run", "recipes/smoke.lua", "greeting=overridden", "ranks=3", "buffer_bytes=4096" })
    assert.are.equal(0, result.code, result.stderr)
    local output = lines(result.stdout)
    assert.are.equal("smoke: overridden", output[1])
    assert.are.equal("smoke: shared memory round-trip ok (4096 bytes)", output[3])
    assert.are.equal("smoke: rank 2 -> host device " .. host_uuid(2), output[6])
    assert.are.equal("smoke: ok", output[7])
  end)

  it("hands converted parameters to run()", function()
    local result = process.wsync({ "run", fixtures.recipes .. "/good.lua", "steps=7", "verbose=true" })
    assert.are.equal(0, result.code, result.stderr)
    assert.matches("^good: steps=7 %(number%) verbose=true %(boolean%) label=fixture version=", result.stdout)
  end)

  it("exits 2 on an unknown parameter, listing the known ones", function()
    local result = process.wsync({ "run", "recipes/smoke.lua", "colour=blue" })
    assert.are.equal(2, result.code)
    assert.are.equal("", result.stdout)
    assert.are.equal("wsync: recipe recipes/smoke.lua has no parameter or field 'colour' "
      .. "(parameters: buffer_bytes, greeting, ranks; fields: backend, bootstrap, buffers, control, description, "
      .. "memory, model, name, params, rollout, run, runtime, schedule, timeouts, trainer, verify)\n", result.stderr)
  end)

  it("overrides any field of a model recipe by its dotted path", function()
    local result = process.wsync({ "run", "recipes/demo.lua", "trainer.steps=1", "buffers.bytes=262144",
      "verify=false" })
    assert.are.equal(0, result.code, result.stderr)
    assert.matches("wsync: verdict: OK: 1 model versions published\n", result.stdout, 1, true)
    assert.matches("buffers 2 x 256.00 KiB", result.stdout, 1, true)
    assert.is_nil(result.stdout:find("verified", 1, true))
  end)

  it("exits 2 on an unknown field, naming the fields there are", function()
    local result = process.wsync({ "run", "recipes/demo.lua", "trainer.stpes=5" })
    assert.are.equal(2, result.code)
    assert.are.equal("", result.stdout)
    assert.are.equal("wsync: recipe recipes/demo.lua has no field 'trainer.stpes' (trainer's fields: kind, ranks, "
      .. "steps, storage)\n", result.stderr)
  end)

  it("exits 2 on a field's value that does not read as its type, 3 on one the recipe refuses", function()
    local result = process.wsync({ "run", "recipes/demo.lua", "trainer.steps=many" })
    assert.are.equal(2, result.code)
    assert.are.equal("wsync: trainer.steps takes a number, got 'many'\n", result.stderr)
    result = process.wsync({ "check", "recipes/demo.lua", "runtime.tp=3" })
    assert.are.equal(3, result.code)
    assert.are.equal("", result.stdout)
    assert.matches("^wsync: recipes/demo.lua: field 'runtime.tp': TP 3 differs from the 2 trainer ranks", result.stderr)
    local tail = "(set on the command line: runtime.tp=3)\n"
    assert.are.equal(tail, result.stderr:sub(-#tail))
  end)

  it("exits 2 on a value that does not convert or a word that is not key=value", function()
    local result = process.wsync({ "run", "recipes/smoke.lua", "ranks=two" })
    assert.are.equal(2, result.code)
    assert.matches("parameter 'ranks' needs a number, got 'two'", result.stderr, 1, true)
    result = process.wsync({ "run", "recipes/smoke.lua", "ranks" })
    assert.are.equal(2, result.code)
    assert.matches("'ranks' is not a key=value parameter", result.stderr, 1, true)
    assert.are.equal("", result.stdout)
  end)

  it("exits 2 without a recipe", function()
    local result = process.wsync({ "run" })
    assert.are.equal(2, result.code)
    assert.matches("wsync run needs a recipe file", result.stderr, 1, true)
  end)

  it("exits 3 on a broken recipe before running anything", function()
    local entry = fixtures.broken[1]
    local result = process.wsync({ "run", entry.path })
    assert.are.equal(3, result.code)
    assert.matches("^wsync: " .. entry.path:gsub("%p", "%%%0") .. ":" .. entry.line .. ": ", result.stderr)
    assert.are.equal("", result.stdout)
  end)
end)

describe("wsync check", function()
  it("summarizes a good recipe as text", function()
    local result = process.wsync({ "check", "recipes/smoke.lua" })
    assert.are.equal(0, result.code, result.stderr)
    assert.are.equal("recipes/smoke.lua: ok: recipe smoke, backend host\n"
      .. "  param buffer_bytes = 1048576\n"
      .. "  param greeting = hello from the smoke recipe\n"
      .. "  param ranks = 2\n", result.stdout)
    assert.are.equal("", result.stderr)
  end)

  it("summarizes a good recipe as JSON, overrides applied", function()
    local result = process.wsync({ "check", fixtures.recipes .. "/good.lua", "--json", "steps=9" })
    assert.are.equal(0, result.code, result.stderr)
    local summary = cjson.decode(result.stdout)
    assert.is_true(summary.ok)
    assert.are.equal("fixture-good", summary.recipe)
    assert.are.equal(fixtures.recipes .. "/good.lua", summary.path)
    assert.are.equal("host", summary.backend)
    assert.are.same({ steps = 9, verbose = false, label = "fixture" }, summary.params)
  end)

  it("checks a model recipe with its fields overridden", function()
    local result = process.wsync({ "check", "recipes/demo.lua", "trainer.ranks=1", "runtime.tp=1",
      "model.preset=tiny" })
    assert.are.equal(0, result.code, result.stderr)
    assert.matches("model        qwen3_moe (tiny), FSDP1 -> TP1\n", result.stdout, 1, true)
  end)

  it("does not run the recipe", function()
    local result = process.wsync({ "check", fixtures.recipes .. "/good.lua" })
    assert.are.equal(0, result.code, result.stderr)
    assert.is_nil(result.stdout:find("good: steps", 1, true))
  end)

  it("exits 2 without a recipe and on an unknown parameter", function()
    assert.are.equal(2, process.wsync({ "check" }).code)
    assert.are.equal(2, process.wsync({ "check", "--json" }).code)
    local result = process.wsync({ "check", "recipes/smoke.lua", "--json", "nope=1" })
    assert.are.equal(2, result.code)
    -- (With --json the usage error is a JSON object on stdout.)
    assert.are.equal("", result.stderr)
    local failure = require("cjson").decode(result.stdout)
    assert.are.equal("USAGE", failure.error.code)
    assert.matches("has no parameter or field 'nope'", failure.error.message, 1, true)
  end)

  for _, entry in ipairs(fixtures.broken) do
    it("exits 3 on " .. entry.file .. ", naming file:line and the field", function()
      local result = process.wsync({ "check", entry.path })
      assert.are.equal(3, result.code, result.stderr)
      assert.are.equal("", result.stdout)
      local prefix = "wsync: " .. entry.path .. ":" .. entry.line .. ": "
      assert.are.equal(prefix, result.stderr:sub(1, #prefix))
      if entry.field then
        assert.matches("field '" .. entry.subject .. "': ", result.stderr, 1, true)
      elseif entry.subject then
        assert.matches("'" .. entry.subject .. "'", result.stderr, 1, true)
      end
      assert.is_nil(result.stderr:find("stack traceback", 1, true))
    end)
  end
end)
