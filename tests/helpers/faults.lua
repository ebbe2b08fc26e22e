--- Test helper: a `wsync run` that must fail fail-stop, and what every such
--- run shares (tests/functional/publish/publish_faults_spec.lua and the vllm
--- runtime's conformance, tests/functional/runtime/vllm_runtime_spec.lua):
--- a non-zero exit, a failed verdict printed once (not again on stderr, by
--- the host or its synthetic ranks, which exit non-zero), no version
--- committed after those before the fault, and nothing left behind.
local assert = require("luassert")
local leftovers = require("tests.helpers.leftovers")

local M = {}

--- Runtime commands of one publication, where a fault fires, and the phase
--- the error must name. The demo's plan has three chunks.
M.COMMANDS = {
  { at = "init_weights", cmd = "init_weights", phase = "init" },
  { at = "start_update", cmd = "start_update", phase = "start" },
  { at = "load_chunk#1", cmd = "load_chunk", phase = "chunks" },
  { at = "load_chunk#2", cmd = "load_chunk", phase = "chunks" },
  { at = "load_chunk#3", cmd = "load_chunk", phase = "chunks" },
  { at = "finish_update", cmd = "finish_update", phase = "finish" },
  -- (No release: a publication's finish_update asks for it, and the
  -- runtime's answer says it released.)
}

--- What the error says for each misbehaviour of the runtime.
M.KINDS = {
  { kind = "crash", causes = { "the control channel closed (EOF)", "exited" } },
  { kind = "hang", causes = { "timeout: no answer to" } },
  { kind = "garbage", causes = { "undecodable frame" } },
}

--- True when `text` holds one of `candidates` (plain text).
function M.says_any(text, candidates)
  for _, candidate in ipairs(candidates) do
    if text:find(candidate, 1, true) then
      return true
    end
  end
  return false
end

--- Runs `wsync run options.recipe` with `options.words` (KEY=VALUE) and
--- `options.env` and checks what every case shares; `survivors`: the
--- trainer ranks alive to hear the error (each exits with code 1);
--- `published`: versions committed before the fault (default none);
--- `timings` (a list) gets {label, wall}. Returns the host's error (the
--- verdict after "FAILED: ") and the run's result.
---@param options {recipe: string, words: string[]?, env: string[]?, survivors: integer, label: string,
---  published: integer?, timings: table[]?}
function M.run_failing(options)
  local result = leftovers.run({ "run", options.recipe, unpack(options.words or {}) },
    { env = options.env, timeout = 30000 })
  if options.timings then
    options.timings[#options.timings + 1] = { label = options.label, wall = result.wall }
  end
  leftovers.assert_clean(result)
  assert.are_not.equal(0, result.code)
  assert.is_false(result.timed_out)

  local failure = result.stdout:match("\nwsync: verdict: FAILED: ([^\n]*)\n")
  assert.is_not_nil(failure, "no failed verdict:\n" .. result.stdout)
  -- The failure is printed once, in the verdict: nothing on stderr, neither
  -- from the host nor from the synthetic ranks it started (whose lines come
  -- through the host, prefixed with their name). Every surviving rank heard
  -- it and exited non-zero by itself (the others died or were killed), as
  -- the closing report says.
  assert.are.equal("", result.stderr)
  local _, times = (result.stdout .. result.stderr):gsub(failure:gsub("%p", "%%%0"), "")
  assert.are.equal(1, times, "the failure is printed more than once:\n" .. result.stdout)
  local ends = result.stdout:match("\nwsync:   synthetic trainer processes: ([^\n]*)\n")
  assert.is_not_nil(ends, result.stdout)
  local _, exited = ends:gsub("exited with code 1", "")
  assert.are.equal(options.survivors, exited, ends)

  -- Nothing committed (after the versions before the fault): no host line,
  -- no committed row in the closing report's table of publications (a
  -- failed one has its row, FAILED).
  local committed, rows = 0, 0
  for _ in result.stdout:gmatch("\nwsync: published model version") do
    committed = committed + 1
  end
  for _ in result.stdout:gmatch("\nwsync:   [^\n]* %d+/%d+ ok[^\n]*") do
    rows = rows + 1
  end
  assert.are.equal(options.published or 0, committed, result.stdout)
  assert.are.equal(options.published or 0, rows, "the closing report lists another version")
  if not options.published then
    assert.is_nil(result.stdout:find("published model version", 1, true), result.stdout)
  end
  return failure, result
end

return M
