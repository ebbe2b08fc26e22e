-- `wsync test`: busted inside the host reports failures through its exit code,
-- and runs the spec files in a shuffled order that its seed gives again.
local process = require("tests.helpers.process")

local failing = "tests/fixtures/failing_spec"
local ordered = "tests/fixtures/order_spec" -- (files a to e)

-- The files of tests/fixtures/order_spec in the order a run's TAP output
-- shows them ("acbed").
local function order_of(result)
  local files = {}
  for file in result.stdout:gmatch("\nok %d+ %- file (%a) runs") do
    files[#files + 1] = file
  end
  return table.concat(files)
end

-- Runs `wsync test` with `args` on the ordered fixture, TAP output.
local function run_ordered(args)
  local words = { "test", "-o", "TAP" }
  for _, word in ipairs(args) do
    words[#words + 1] = word
  end
  words[#words + 1] = ordered
  local result = process.wsync(words)
  assert.are.equal(0, result.code, result.stdout .. result.stderr)
  result.stdout = "\n" .. result.stdout -- (so that the first line starts with a newline too)
  return result
end

describe("wsync test", function()
  it("exits non-zero when a spec fails, naming the failure", function()
    local result = process.wsync({ "test", failing })
    assert.are_not.equal(0, result.code)
    assert.matches("1 success / 1 failure / 0 errors", result.stdout, 1, true)
    assert.matches("fails on purpose", result.stdout, 1, true)
  end)

  it("exits 0 when the selected specs pass", function()
    local result = process.wsync({ "test", "--filter=passes", failing })
    assert.are.equal(0, result.code, result.stdout .. result.stderr)
    assert.matches("1 success / 0 failures / 0 errors", result.stdout, 1, true)
  end)

  it("runs the files in name order, and says nothing of a seed, when nothing shuffles", function()
    local result = run_ordered({})
    assert.are.equal("abcde", order_of(result))
    assert.is_nil(result.stdout:find("seed", 1, true), result.stdout)
  end)

  it("with --shuffle-files, prints the seed it chose, which gives the same order again", function()
    local first = run_ordered({ "--shuffle-files" })
    local seed = first.stdout:match("\nwsync test: a shuffled order, seed (%d+) %(the same order again: "
      .. "%-%-seed=%d+%)\n")
    assert.is_not_nil(seed, first.stdout)
    assert.are.equal(5, #order_of(first), first.stdout)
    local again = run_ordered({ "--shuffle-files", "--seed=" .. seed })
    assert.are.equal(order_of(first), order_of(again))
    assert.matches("seed " .. seed .. " ", again.stdout, 1, true)
  end)

  it("with --shuffle-files and a seed, runs every file in an order that the seed fixes", function()
    -- (Fixed seeds: the same orders every time, and not all of them by name.)
    local shuffled = 0
    for _, seed in ipairs({ "1", "2", "3" }) do
      local order = order_of(run_ordered({ "--shuffle-files", "--seed", seed }))
      local letters = {}
      for letter in order:gmatch("%a") do
        letters[#letters + 1] = letter
      end
      table.sort(letters)
      assert.are.equal("abcde", table.concat(letters), "seed " .. seed .. ": " .. order)
      assert.are.equal(order, order_of(run_ordered({ "--seed=" .. seed, "--shuffle-files" })), "seed " .. seed)
      shuffled = shuffled + (order ~= "abcde" and 1 or 0)
    end
    assert.is_true(shuffled > 0, "seeds 1 to 3 all ran the files by name")
  end)

  it("with --no-shuffle after --shuffle-files, keeps the name order", function()
    local result = run_ordered({ "--shuffle-files", "--seed=2", "--no-shuffle" })
    assert.are.equal("abcde", order_of(result))
    assert.is_nil(result.stdout:find("shuffled", 1, true), result.stdout)
  end)
end)
