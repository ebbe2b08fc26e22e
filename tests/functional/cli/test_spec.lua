-- `wsync test`: busted inside the host reports failures through its exit code.
local process = require("tests.helpers.process")

local failing = "tests/fixtures/failing_spec"

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
end)
