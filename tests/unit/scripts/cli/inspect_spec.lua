-- wsync.cli.inspect: the readable text the REPL prints for values.
local inspect = require("wsync.cli.inspect")

describe("wsync.cli.inspect", function()
  it("writes scalars as Lua would", function()
    assert.are.equal("nil", inspect.inspect(nil))
    assert.are.equal("true", inspect.inspect(true))
    assert.are.equal("42", inspect.inspect(42))
    assert.are.equal("1.5", inspect.inspect(1.5))
    assert.are.equal("-inf", inspect.inspect(-math.huge))
  end)

  it("quotes strings with %q and keeps them on one line", function()
    assert.are.equal('"hello"', inspect.inspect("hello"))
    assert.are.equal('"say \\"hi\\""', inspect.inspect('say "hi"'))
    assert.are.equal('"a\\nb"', inspect.inspect("a\nb"))
    assert.are.equal('"back\\\\slash\\nnext"', inspect.inspect("back\\slash\nnext"))
    assert.are.equal('"\\27[K\\0"', inspect.inspect("\27[K\0"))
  end)

  it("writes small flat tables on one line, array part first, keys sorted", function()
    assert.are.equal("{}", inspect.inspect({}))
    assert.are.equal("{ 1, 2, 3 }", inspect.inspect({ 1, 2, 3 }))
    assert.are.equal('{ "x", "y", a = 1, b = 2, c = 3 }', inspect.inspect({ c = 3, "x", a = 1, b = 2, "y" }))
  end)

  it("orders keys numbers first, then strings, then booleans, and brackets the odd ones", function()
    local text = inspect.inspect({ [10] = "ten", zebra = 1, [true] = "t", [false] = "f", [2.5] = "x",
      ["with space"] = 2, ["end"] = 3 }, { width = 200 })
    assert.are.equal('{ [2.5] = "x", [10] = "ten", ["end"] = 3, ["with space"] = 2, zebra = 1, '
      .. '[false] = "f", [true] = "t" }', text)
  end)

  it("indents nested tables one entry per line", function()
    local text = inspect.inspect({ name = "smoke", params = { ranks = 2, tags = { "a", "b" } }, 7 })
    assert.are.equal(table.concat({
      "{",
      "  7,",
      '  name = "smoke",',
      "  params = {",
      "    ranks = 2,",
      '    tags = { "a", "b" }',
      "  }",
      "}",
    }, "\n"), text)
  end)

  it("breaks a flat table that does not fit the width", function()
    local long = {}
    for index = 1, 30 do
      long[index] = index * 1000
    end
    local text = inspect.inspect(long)
    assert.matches("^{\n  1000,\n  2000,\n", text)
    assert.matches("\n  30000\n}$", text)
    assert.are.equal("{ 1, 2 }", inspect.inspect({ 1, 2 }, { width = 8 }))
    assert.are.equal("{\n  1,\n  2\n}", inspect.inspect({ 1, 2 }, { width = 7 }))
  end)

  it("shows a table inside itself as <cycle>, and shared tables in full", function()
    local node = { name = "a" }
    node.self = node
    assert.are.equal('{ name = "a", self = <cycle> }', inspect.inspect(node))
    local shared = { 1 }
    assert.are.equal("{\n  a = { 1 },\n  b = { 1 }\n}", inspect.inspect({ a = shared, b = shared }))
  end)

  it("stops at the depth limit", function()
    local deep = { level1 = { level2 = { level3 = { level4 = {} } } } }
    assert.are.equal("{ level1 = {...} }", inspect.inspect(deep, { depth = 1 }))
    assert.are.equal("{...}", inspect.inspect(deep, { depth = 0 }))
    assert.matches("level3 = { level4 = {} }", inspect.inspect(deep))
  end)

  it("shows functions, userdata, threads and table keys through tostring and recursion", function()
    local fn = function() end
    assert.are.equal(tostring(fn), inspect.inspect(fn))
    assert.matches("^thread: ", inspect.inspect(coroutine.create(fn)))
    assert.matches("^file %(0x", inspect.inspect(io.stdout))
    assert.are.equal('{\n  [{ 1 }] = "k"\n}', inspect.inspect({ [{ 1 }] = "k" }))
  end)

  it("ignores metatables and shows the raw contents", function()
    local object = setmetatable({ x = 1 }, { __index = { hidden = true }, __tostring = function() return "obj" end })
    assert.are.equal("{ x = 1 }", inspect.inspect(object))
  end)

  it("survives a __tostring that raises", function()
    local weird = newproxy(true)
    getmetatable(weird).__tostring = function() error("no") end
    assert.are.equal("<userdata>", inspect.inspect(weird))
  end)

  it("joins several values with tabs, nils included", function()
    assert.are.equal('1\t"a"\tnil\tnil', inspect.inspect_values(1, "a", nil, nil))
    assert.are.equal("nil", inspect.inspect_values(nil))
    assert.are.equal("", inspect.inspect_values())
  end)

  it("summarizes a table one level deep: short tables written out, the others by size, long strings cut", function()
    local value = { 10, 20, name = "x", small = { a = 1 }, big = { { 1 }, { 2 } }, list = { 1, 2, 3, k = "v" },
      text = ("y"):rep(80), empty = {} }
    assert.are.equal(table.concat({
      '{ -- 2 items, 6 fields, 99 lines in full: show(v) prints it whole',
      "  10,",
      "  20,",
      "  big = { 2 items },",
      "  empty = {},",
      "  list = { 1, 2, 3, k = \"v\" },",
      '  name = "x",',
      "  small = { a = 1 },",
      '  text = "' .. ("y"):rep(57) .. '"...,',
      "}",
    }, "\n"), inspect.summary(value, 99, "show(v) prints it whole"))
  end)

  it("shows at most SUMMARY_ENTRIES entries of a summary, saying how many more there are", function()
    local list = {}
    for index = 1, inspect.SUMMARY_ENTRIES + 5 do
      list[index] = index
    end
    local text = inspect.summary(list, 30, "hint")
    assert.matches("\n  %.%.%. 5 more\n}$", text)
    assert.are.equal(inspect.SUMMARY_ENTRIES + 3, #text:gsub("[^\n]", "") + 1)
  end)
end)
