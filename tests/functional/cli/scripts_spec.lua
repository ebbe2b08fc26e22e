-- Where wsync's Lua scripts come from: the source tree in a build tree, the
-- bytecode embedded in the binary otherwise.
local uv = require("luv")
local process = require("tests.helpers.process")

local embedded = { "WSYNC_SCRIPTS=embedded" }

-- Module names of the .lua files under scripts/wsync ("wsync", "wsync.cli").
local function source_modules()
  local names = {}
  local function walk(directory, prefix)
    local scanner = assert(uv.fs_scandir(directory))
    while true do
      local name, kind = uv.fs_scandir_next(scanner)
      if not name then
        break
      end
      if kind == "directory" then
        walk(directory .. "/" .. name, prefix .. "." .. name)
      elseif name:match("%.lua$") then
        local module = name == "init.lua" and prefix or (prefix .. "." .. name:gsub("%.lua$", ""))
        names[#names + 1] = module
      end
    end
  end
  walk("scripts/wsync", "wsync")
  table.sort(names)
  return names
end

describe("embedded scripts", function()
  it("are used when WSYNC_SCRIPTS=embedded", function()
    local result = process.wsync({ "-e", [[
      local wsync = require("wsync")
      print(wsync.script_source)
      print(debug.getinfo(require("wsync.errors").new, "S").source)]] }, nil, { env = embedded })
    assert.are.equal(0, result.code, result.stderr)
    assert.are.equal("embedded\n@scripts/wsync/errors.lua\n", result.stdout)
  end)

  it("are not used from the build tree by default", function()
    local result = process.wsync({ "-e", 'print(require("wsync").script_source)' })
    assert.are.equal(0, result.code, result.stderr)
    assert.matches("/scripts\n$", result.stdout)
    assert.are_not.equal("embedded\n", result.stdout)
  end)

  it("are every .lua file under scripts/wsync", function()
    local result = process.wsync({ "-e",
      'print(table.concat(require("wsync._host").embedded_modules(), "\\n"))' }, nil, { env = embedded })
    assert.are.equal(0, result.code, result.stderr)
    local listed = {}
    for name in result.stdout:gmatch("[^\n]+") do
      listed[#listed + 1] = name
    end
    table.sort(listed)
    assert.are.same(source_modules(), listed)
  end)

  it("run the smoke recipe", function()
    local result = process.wsync({ "run", "recipes/smoke.lua" }, nil, { env = embedded })
    assert.are.equal(0, result.code, result.stderr)
    assert.matches("smoke: ok\n$", result.stdout)
  end)

  it("report recipe errors like the source tree does", function()
    local path = "tests/fixtures/recipes/bad_param.lua"
    local from_source = process.wsync({ "check", path })
    local from_bytecode = process.wsync({ "check", path }, nil, { env = embedded })
    assert.are.equal(3, from_bytecode.code)
    assert.are.equal(from_source.stderr, from_bytecode.stderr)
  end)
end)
