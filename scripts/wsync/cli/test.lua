--- `wsync test`: busted inside the host, with the same bindings and loop that
--- wsync itself uses. Arguments are busted's own. When they shuffle the order
--- (busted's --shuffle-files, --shuffle-tests or --shuffle), the seed is
--- chosen here unless --seed gives it, and printed first, so that a failure
--- that comes from the order can be run again in that order.
local M = {}

-- busted's flags that shuffle: what each sets (`--no-<flag>` clears it).
local SHUFFLE_FLAGS = {
  shuffle = { "files", "tests" }, ["shuffle-files"] = { "files" }, ["shuffle-tests"] = { "tests" },
}

--- What busted's arguments `args` ask of the order: whether they shuffle it
--- (the last of a flag and its --no- form counts) and the seed they give
--- (`--seed=N` or `--seed N`), nil when none.
---@param args string[]
---@return boolean shuffled, string? seed
function M.order_of(args)
  local shuffled, seed = {}, nil
  local i = 1
  while i <= #args do
    local word = args[i]
    local cleared = word:match("^%-%-no%-([%w-]+)$")
    local flag = cleared or word:match("^%-%-([%w-]+)$")
    if SHUFFLE_FLAGS[flag] then
      for _, part in ipairs(SHUFFLE_FLAGS[flag]) do
        shuffled[part] = cleared == nil
      end
    elseif word == "--seed" then
      seed = args[i + 1]
      i = i + 1
    elseif word:match("^%-%-seed=") then
      seed = word:sub(#"--seed=" + 1)
    end
    i = i + 1
  end
  return shuffled.files == true or shuffled.tests == true, seed
end

--- Runs busted with `args`; returns the exit code (0 when every test passed).
---@param args string[]
---@return integer
function M.main(args)
  local found, compatibility = pcall(require, "busted.compatibility")
  if not found then
    io.stderr:write("wsync test: busted is not installed (Debian package lua-busted): ",
      tostring(compatibility), "\n")
    return 1
  end
  -- busted ends by calling exit; make that return through the host instead of
  -- ending the process, so the host closes in order.
  compatibility.exit = function(code)
    os.exit(code == 0 and 0 or 1)
  end
  local busted_args = { [0] = "wsync test" }
  local shuffled, seed = M.order_of(args)
  if shuffled then
    if seed == nil then
      seed = tostring(require("busted.utils").urandom() or os.time())
      busted_args[1] = "--seed=" .. seed
    end
    io.stdout:write(string.format("wsync test: a shuffled order, seed %s (the same order again: --seed=%s)\n", seed,
      seed))
    io.stdout:flush()
  end
  for _, value in ipairs(args) do
    busted_args[#busted_args + 1] = value
  end
  _G.arg = busted_args
  require("busted.runner")({ standalone = false })
  return 0
end

return M
