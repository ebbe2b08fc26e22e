-- wsync.recipe.schema: validators, failure paths, defaults, unknown fields.
local schema = require("wsync.recipe.schema")

-- Checks `value` and returns the failure, asserting that there is one.
local function failure_of(spec, value)
  local result, failure = schema.check(spec, value)
  assert.is_nil(result)
  assert.is_table(failure)
  return failure
end

describe("schema validators", function()
  it("string: type and pattern", function()
    assert.are.equal("abc", schema.check(schema.string({}), "abc"))
    local failure = failure_of(schema.string({}), 5)
    assert.are.equal("", failure.path)
    assert.are.equal("expected a string, got 5", failure.message)
    failure = failure_of(schema.string({ pattern = "^%l+$" }), "Abc")
    assert.are.equal('"Abc" does not match ^%l+$', failure.message)
  end)

  it("number: type, NaN, integer, min and max", function()
    assert.are.equal(2.5, schema.check(schema.number({}), 2.5))
    assert.are.equal("expected a number, got \"1\"", failure_of(schema.number({}), "1").message)
    assert.matches("^expected a finite number, got ", failure_of(schema.number({}), 0 / 0).message)
    assert.are.equal("expected a finite number, got inf", failure_of(schema.number({}), math.huge).message)
    assert.are.equal("expected a finite number, got -inf", failure_of(schema.number({}), -math.huge).message)
    assert.are.equal("expected an integer, got 1.5", failure_of(schema.number({ integer = true }), 1.5).message)
    assert.are.equal(4, schema.check(schema.number({ integer = true, min = 4, max = 4 }), 4))
    assert.are.equal("must be at least 1, got 0", failure_of(schema.number({ min = 1 }), 0).message)
    assert.are.equal("must be at most 8, got 9", failure_of(schema.number({ max = 8 }), 9).message)
  end)

  it("number: bounds read as integers in full, with their reason; the value as written", function()
    local exact = schema.number({ integer = true, max = 2 ^ 53, max_why = "2^53" })
    assert.are.equal("must be at most 9007199254740992 (2^53), got 1e+308", failure_of(exact, 1e308).message)
    assert.are.equal("must be at most 9007199254740992 (2^53), got 9.2233720368548e+18",
      failure_of(exact, 2 ^ 63).message)
    assert.are.equal("must be at least 0.001, got 0", failure_of(schema.number({ min = 0.001 }), 0).message)
    assert.are.equal("must be at least -9007199254740992, got -1e+308",
      failure_of(schema.number({ min = -2 ^ 53 }), -1e308).message)
  end)

  it("boolean: only true and false", function()
    assert.is_false(schema.check(schema.boolean({}), false))
    assert.are.equal("expected true or false, got \"true\"", failure_of(schema.boolean({}), "true").message)
    assert.are.equal("expected true or false, got 0", failure_of(schema.boolean({}), 0).message)
  end)

  it("enum: one of the listed values, listed in the failure", function()
    local spec = schema.enum({ "host", "cuda" })
    assert.are.equal("cuda", schema.check(spec, "cuda"))
    assert.are.equal('expected one of host, cuda, got "tpu"', failure_of(spec, "tpu").message)
    assert.are.same({ "host", "cuda" }, spec.values)
    assert.is_nil(spec[1])
  end)

  it("func: only functions", function()
    local fn = function() end
    assert.are.equal(fn, schema.check(schema.func({}), fn))
    assert.are.equal("expected a function, got a table", failure_of(schema.func({}), {}).message)
  end)

  it("scalar: strings, numbers and booleans only", function()
    for _, value in ipairs({ "s", 1, true }) do
      assert.are.equal(value, schema.check(schema.scalar({}), value))
    end
    assert.are.equal("expected a string, number or boolean, got a table",
      failure_of(schema.scalar({}), {}).message)
    assert.matches("^expected a string, number or boolean, got function",
      failure_of(schema.scalar({}), print).message)
  end)

  it("list: items, minimum length, and no keys beyond the sequence", function()
    local spec = schema.list({ item = schema.number({}), min_length = 2 })
    assert.are.same({ 1, 2, 3 }, schema.check(spec, { 1, 2, 3 }))
    assert.are.equal("needs at least 2 entries, has 1", failure_of(spec, { 1 }).message)
    local failure = failure_of(spec, { 1, "two", 3 })
    assert.are.equal("[2]", failure.path)
    assert.are.equal("expected a list, got 7", failure_of(spec, 7).message)
    failure = failure_of(spec, { 1, 2, extra = 3 })
    assert.are.equal("extra", failure.path)
    assert.are.equal("unexpected key in a list", failure.message)
  end)

  it("list: a stray numeric key is written as an index", function()
    local spec = schema.record({ fields = { items = schema.list({ item = schema.number({}) }) } })
    assert.are.equal("items[0]", failure_of(spec, { items = { [0] = 1, 2 } }).path)
    assert.are.equal("items[1.5]", failure_of(spec, { items = { 1, [1.5] = 2 } }).path)
  end)

  it("map: string keys and uniform values", function()
    local spec = schema.map({ item = schema.number({}) })
    assert.are.same({ a = 1, b = 2 }, schema.check(spec, { a = 1, b = 2 }))
    assert.are.equal("keys must be strings, got 1", failure_of(spec, { 5 }).message)
    local failure = failure_of(spec, { a = 1, b = "x" })
    assert.are.equal("b", failure.path)
    assert.are.equal("expected a table, got \"m\"", failure_of(spec, "m").message)
  end)
end)

describe("schema records", function()
  local spec = schema.record({
    fields = {
      name = schema.string({ required = true }),
      backend = schema.enum({ "host", "cuda", default = "host" }),
      verbose = schema.boolean({ default = false }),
      retries = schema.number({ integer = true, default = 3 }),
      params = schema.map({ item = schema.scalar({}), default = {} }),
      tags = schema.list({ item = schema.string({}), default = { "a", "b" } }),
    },
  })

  it("fills defaults, copying table defaults", function()
    local first = assert(schema.check(spec, { name = "x" }))
    assert.are.same({ name = "x", backend = "host", verbose = false, retries = 3, params = {}, tags = { "a", "b" } },
      first)
    first.params.changed = true
    first.tags[1] = "changed"
    local second = assert(schema.check(spec, { name = "y" }))
    assert.are.same({}, second.params)
    assert.are.same({ "a", "b" }, second.tags)
  end)

  it("returns a new table and leaves the input alone", function()
    local input = { name = "x", params = { k = 1 } }
    local result = assert(schema.check(spec, input))
    assert.are_not.equal(input, result)
    assert.are_not.equal(input.params, result.params)
    assert.is_nil(input.backend)
  end)

  it("names a missing required field", function()
    local failure = failure_of(spec, { backend = "cuda" })
    assert.are.equal("name", failure.path)
    assert.are.equal("is required", failure.message)
  end)

  it("names an unknown field and lists the known ones", function()
    local failure = failure_of(spec, { name = "x", bakend = "cuda" })
    assert.are.equal("bakend", failure.path)
    assert.are.equal("unknown field (known: backend, name, params, retries, tags, verbose)", failure.message)
  end)

  it("writes a numeric unknown key as an index", function()
    assert.are.equal("[1]", failure_of(spec, { "positional", name = "x" }).path)
  end)

  it("keeps unknown fields of an open record", function()
    local open = schema.record({ open = true, fields = { a = schema.number({ default = 1 }) } })
    assert.are.same({ a = 1, extra = "kept" }, schema.check(open, { extra = "kept" }))
  end)

  it("runs the record's check after its fields, naming the field it blames", function()
    local ranged = schema.record({
      fields = { low = schema.number({}), high = schema.number({}) },
      check = function(value)
        if value.low > value.high then
          return false, "low is above high", "low"
        end
        return true
      end,
    })
    assert.is_table(schema.check(ranged, { low = 1, high = 2 }))
    local failure = failure_of(ranged, { low = 3, high = 2 })
    assert.are.equal("low", failure.path)
    assert.are.equal("low is above high", failure.message)
  end)

  it("writes nested paths like a.b[2].c", function()
    local nested = schema.record({
      fields = {
        a = schema.record({
          fields = { b = schema.list({ item = schema.record({ fields = { c = schema.number({}) } }) }) },
        }),
      },
    })
    local failure = failure_of(nested, { a = { b = { { c = 1 }, { c = "x" } } } })
    assert.are.equal("a.b[2].c", failure.path)
    assert.are.equal('expected a number, got "x"', failure.message)
    failure = failure_of(nested, { a = { b = { { c = 1 }, { d = 2 } } } })
    assert.are.equal("a.b[2].d", failure.path)
    failure = failure_of(nested, { a = { b = { { c = 1 }, 5 } } })
    assert.are.equal("a.b[2]", failure.path)
  end)

  it("passes errors that are not validation failures through", function()
    local broken = schema.record({
      fields = {},
      check = function()
        error("check exploded", 0)
      end,
    })
    assert.has_error(function()
      schema.check(broken, {})
    end, "check exploded")
  end)
end)
