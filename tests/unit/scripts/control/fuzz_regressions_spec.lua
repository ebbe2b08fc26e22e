-- The fuzz target's inputs replayed without the fuzzer: every input kept in
-- tests/fuzz/regressions/ (each once made wsync crash, raise an uncoded error
-- or leave a peer waiting; tests/fuzz/README.md says which) and
-- the seed corpus go through tests/fuzz/entry.lua as the fuzz target runs
-- them, and must pass. Also checks that the entry tells a finding from an
-- expected rejection.
local uv = require("luv")
local entry = require("tests.fuzz.entry")
local recipe = require("wsync.recipe")

local function inputs(folder)
  local names = {}
  local scanner = assert(uv.fs_scandir(folder))
  while true do
    local name = uv.fs_scandir_next(scanner)
    if not name then
      break
    end
    names[#names + 1] = name
  end
  table.sort(names)
  return names
end

local function read(path)
  local file = assert(io.open(path, "rb"))
  local bytes = file:read("*a")
  file:close()
  return bytes
end

local function finding_of(input)
  local ok, err = pcall(entry.run, input)
  assert.is_false(ok, "expected a finding")
  return tostring(err)
end

describe("the fuzz entry", function()
  teardown(function()
    entry.cleanup()
  end)

  for _, folder in ipairs({ "tests/fuzz/regressions", "tests/fuzz/corpus" }) do
    local names = inputs(folder)
    it("has inputs in " .. folder, function()
      assert.is_true(#names > 0)
    end)
    for _, name in ipairs(names) do
      it("passes " .. folder .. "/" .. name, function()
        entry.run(read(folder .. "/" .. name))
      end)
    end
  end

  it("takes a recipe that runs forever, even inside pcall, as a rejection", function()
    entry.run(entry.mode_byte("recipe") .. "while true do pcall(function() while true do end end) end")
    entry.run(entry.mode_byte("recipe") .. "local t = {} for i = 1, 1e9 do t[i] = i end return t")
  end)

  describe("with a broken loader", function()
    local load = recipe.load
    after_each(function()
      recipe.load = load
    end)

    it("reports a plain Lua error from wsync's code as a finding", function()
      recipe.load = function()
        local loaded = {}
        return loaded.recipe.name -- attempt to index a nil value
      end
      assert.matches("wsync fuzz finding: wsync.recipe.load raised an error that is not a coded wsync error",
        finding_of(entry.mode_byte("recipe") .. "return {}"), 1, true)
    end)

    it("reports a loader that runs past the budget in its own code as a finding", function()
      recipe.load = function()
        while true do
        end
      end
      assert.matches("ran out of its instruction budget in wsync's code",
        finding_of(entry.mode_byte("recipe") .. "return {}"), 1, true)
    end)
  end)

  it("reports a request that a peer leaves unanswered", function()
    local body = '{"protocol":1,"id":1,"cmd":"state","payload":{}}'
    entry.run(entry.mode_byte("host_peer", true) .. "\0" .. body)
    local protocol = require("wsync.control.protocol")
    local success = protocol.success
    protocol.success = function()
      return { protocol = 1, id = 0 / 0, cmd = "state", ok = true, result = {} } -- cannot be encoded
    end
    local ok, err = pcall(entry.run, entry.mode_byte("host_peer", true) .. "\0" .. body)
    protocol.success = success
    assert.is_false(ok)
    assert.matches("answered 0 of its 1 requests", tostring(err), 1, true)
  end)
end)
