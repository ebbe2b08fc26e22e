-- wsync.recipe.fields: the recipe's schema, section by section: bounds that
-- name the value as written, each section's own checks, defaults.
local fields = require("wsync.recipe.fields")
local load_module = require("wsync.recipe.load")
local schema = require("wsync.recipe.schema")
local fixtures = require("tests.helpers.fixtures")
local recipes = require("tests.helpers.recipes")

local error_of = require("tests.helpers.errors").error_of

local model_recipe, refused = recipes.model, recipes.refused

describe("numbers", function()
  -- Every number that reaches a byte count, a process count, a version or a
  -- timer: huge values are refused at validation, naming the value as the
  -- recipe wrote it (not as an int64 conversion prints it).
  local FIELDS = {
    { path = "buffers.bytes", set = function(v) return { buffers = { bytes = v } } end },
    { path = "buffers.count", set = function(v) return { buffers = { count = v } } end },
    { path = "trainer.ranks", set = function(v) return { trainer = { ranks = v } } end },
    { path = "trainer.steps", set = function(v) return { trainer = { steps = v } } end },
    { path = "runtime.tp", set = function(v) return { runtime = { tp = v } } end },
    { path = "runtime.grace_ms", set = function(v) return { runtime = { grace_ms = v } } end },
    { path = "memory.device_bytes", set = function(v) return { memory = { device_bytes = v } } end },
    { path = "memory.kv_bytes", set = function(v) return { memory = { kv_bytes = v } } end },
    { path = "memory.headroom_bytes", set = function(v) return { memory = { headroom_bytes = v } } end },
    { path = "memory.optimizer_factor", set = function(v) return { memory = { optimizer_factor = v } } end },
    { path = "timeouts.load_chunk", set = function(v) return { timeouts = { load_chunk = v } } end },
    { path = "timeouts.startup", set = function(v) return { timeouts = { startup = v } } end },
  }
  for _, field in ipairs(FIELDS) do
    for _, value in ipairs({ 1e308, 2 ^ 63, 2 ^ 53 + 2 }) do
      it("refuses " .. field.path .. " = " .. tostring(value) .. ", naming it as written", function()
        local failure = refused(field.set(value))
        assert.are.equal(field.path, failure.path)
        assert.matches(", got " .. tostring(value):gsub("%p", "%%%0") .. "$", failure.message)
        assert.is_nil(failure.message:find("9223372036854775808", 1, true))
      end)
    end
  end

  it("says what bounds each number and why", function()
    assert.are.equal("must be at most 9007199254740992 (2^53, the largest integer a Lua number holds exactly), "
      .. "got 1e+308", refused({ buffers = { bytes = 1e308 } }).message)
    assert.are.equal("must be at most 604800 (a week), got 1e+300", refused({ timeouts = { startup = 1e300 } }).message)
    assert.are.equal("must be at most 64 (64 times the parameters' bytes), got 1000",
      refused({ memory = { optimizer_factor = 1000 } }).message)
  end)

  it("needs buffers.bytes unless the path is direct (no packed buffers)", function()
    local given = model_recipe()
    given.buffers = { count = 2 }
    local _, failure = schema.check(fields.schema, given)
    assert.are.equal("buffers", failure.path)
    assert.are.equal("give bytes, the size of each packed buffer (or direct = true: none)", failure.message)
    given.buffers, given.backend, given.trainer.ranks, given.runtime.tp = { direct = true }, "cuda", 1, 1
    local checked, refusal = schema.check(fields.schema, given)
    assert.is_table(checked, refusal and refusal.message)
  end)

  it("accepts the bounds themselves", function()
    assert.is_table(schema.check(fields.schema, model_recipe({ memory = { device_bytes = 2 ^ 53,
      headroom_bytes = 2 ^ 50 }, timeouts = { startup = fields.MAX_SECONDS }, trainer = { steps = 2 ^ 53 } })))
  end)
end)

describe("verify", function()
  it("takes false, true, \"synthetic\" and \"values\" and says which check each makes", function()
    for value, mode in pairs({ [false] = false, [true] = "synthetic", synthetic = "synthetic", values = "values" }) do
      local checked = assert(schema.check(fields.schema, model_recipe({ verify = value })))
      assert.are.equal(mode, fields.verify_mode(checked))
    end
    assert.are.equal(false, fields.verify_mode(assert(schema.check(fields.schema, model_recipe()))))
  end)

  it("refuses another value", function()
    local failure = refused({ verify = "yes" })
    assert.are.equal("verify", failure.path)
    assert.matches("expected one of false, true, synthetic, values", failure.message, 1, true)
  end)
end)

describe("runtime", function()
  it("refuses a vllm runtime without its model directory, naming runtime.model at its line", function()
    local path = fixtures.recipes .. "/runtime_vllm.lua"
    local err = error_of(load_module.load, path)
    assert.are.equal("RECIPE_INVALID", err.code)
    assert.are.equal("runtime.model", err.field)
    assert.are.equal(fixtures.bad_line(path), err.line)
  end)

  it("refuses a vLLM share of the device that is not a number above 0 and at most 1 (a fuzz finding)", function()
    for _, bad in ipairs({ {}, "0.5", 0, -0.1, 1.5, 0 / 0 }) do
      local failure = refused({ runtime = { kind = "vllm", model = "m", vllm = { gpu_memory_utilization = bad } } })
      assert.are.equal("runtime.vllm.gpu_memory_utilization", failure.path)
      assert.matches("is vLLM's share of the device, a number above 0 and at most 1; got ", failure.message, 1, true)
    end
    assert.is_table(schema.check(fields.schema, model_recipe({ runtime = { kind = "vllm", model = "m",
      vllm = { gpu_memory_utilization = 1 } } })))
  end)

  it("refuses vllm runtime fields on another runtime, naming the field", function()
    local failure = refused({ runtime = { kind = "reference", load = "native" } })
    assert.are.same({ path = "runtime.load", message = "is for the vllm runtime; this recipe's runtime is reference" },
      failure)
  end)
end)

describe("control", function()
  it("takes a socket path, and a TCP endpoint's token from the environment or a file", function()
    assert.is_table(schema.check(fields.schema, model_recipe({ control = { endpoint = "/tmp/wsync.sock" } })))
    assert.is_table(schema.check(fields.schema, model_recipe({ control = { tcp = "127.0.0.1:0", token_env = "T" } })))
    assert.is_table(schema.check(fields.schema, model_recipe({ control = { tcp = "127.0.0.1:0",
      token_file = "token" } })))
  end)

  it("refuses a token without TCP, and a token given in two places", function()
    local failure = refused({ control = { token_env = "T" } })
    assert.are.equal("control.token_env", failure.path)
    assert.matches("gives the token of the TCP endpoint; this recipe has no control.tcp", failure.message, 1, true)
    failure = refused({ control = { tcp = "127.0.0.1:0", token_env = "T", token_file = "f" } })
    assert.are.equal("control.token_file", failure.path)
    assert.are.equal("give the token in one place: token_env or token_file", failure.message)
  end)
end)

describe("timeouts", function()
  it("takes every key of wsync.control.timeouts, and no other", function()
    local keys = {}
    for index, entry in ipairs(require("wsync.control.timeouts").KEYS) do
      keys[index] = entry.key
    end
    assert.are.same(keys, fields.TIMEOUT_KEYS)
    local failure = refused({ timeouts = { lunch = 5 } })
    assert.are.equal("timeouts.lunch", failure.path)
    assert.matches("^unknown field %(known: ", failure.message)
  end)
end)

describe("schema_of", function()
  it("finds a field's schema by its dotted path, through records and maps", function()
    assert.are.equal(fields.schema.fields.trainer.fields.steps, fields.schema_of("trainer.steps"))
    assert.are.equal("any", fields.schema_of("model.config.hidden_size").kind, "a map's keys are any")
    assert.are.equal(fields.schema, fields.schema_of(""))
  end)

  it("names the record that lacks a field, and a field that is no table of fields", function()
    local spec, parent, record = fields.schema_of("trainer.stpes")
    assert.is_nil(spec)
    assert.are.same({ "trainer", fields.schema.fields.trainer }, { parent, record })
    spec, parent = fields.schema_of("colour")
    assert.is_nil(spec)
    assert.are.equal("", parent)
    spec, parent, record = fields.schema_of("trainer.steps.x")
    assert.is_nil(spec)
    assert.are.same({ "trainer.steps", "number" }, { parent, record.kind })
  end)
end)
