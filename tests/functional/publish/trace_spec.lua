-- A publication's trace (its `trace` option) that tests/bench/cuda_publish.lua
-- prints: per chunk, when its fill and its load were asked for and
-- answered, and their copies' own time; the demo run in this process on the
-- host backend, with the session's publication options.
local process = require("tests.helpers.process")
local recipe_module = require("wsync.recipe")
local session = require("wsync.publish.session")

local function demo(publication)
  return process.in_coroutine(function()
    return session.run(recipe_module.load("recipes/demo.lua"), { publication = publication })
  end)
end

describe("a publication's trace option", function()
  it("gives each report every chunk's fill and load, asked before answered, in the pipeline's order", function()
    local reports = demo({ trace = true })
    assert.are.equal(3, #reports)
    for _, report in ipairs(reports) do
      assert.are.equal(report.chunks, #report.trace)
      for k, chunk in ipairs(report.trace) do
        for _, side in ipairs({ "fill", "load" }) do
          local asked, answered, copy = unpack(chunk[side])
          assert.is_true(asked >= 0 and asked <= answered and answered <= report.timings.total, side .. " " .. k)
          assert.is_true(copy >= 0 and copy <= answered - asked + 1e-3, side .. " " .. k)
        end
        -- The consensus gate: a chunk loads once every rank filled it; and a
        -- buffer (two of them) fills again once its last chunk loaded.
        assert.is_true(chunk.load[1] >= chunk.fill[2], "chunk " .. k)
        if k > 2 then
          assert.is_true(chunk.fill[1] >= report.trace[k - 2].load[2], "chunk " .. k)
        end
      end
    end
  end)

  it("with the serial option, moves each chunk's fill and then its load, never at once", function()
    local reports = demo({ trace = true, serial = true })
    assert.are.equal(3, #reports)
    for _, report in ipairs(reports) do
      assert.are.equal(report.chunks, #report.trace)
      for k, chunk in ipairs(report.trace) do
        assert.is_true(chunk.load[1] >= chunk.fill[2], "chunk " .. k)
        if k > 1 then
          assert.is_true(chunk.fill[1] >= report.trace[k - 1].load[2], "chunk " .. k)
        end
      end
    end
  end)

  it("is kept by no report when off", function()
    local reports = demo()
    assert.are.equal(3, #reports)
    assert.is_nil(reports[1].trace)
  end)
end)
