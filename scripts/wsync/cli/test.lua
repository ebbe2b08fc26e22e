--- `wsync test`: busted inside the host, with the same bindings and loop that
--- wsync itself uses. Arguments are busted's own.
local M = {}

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
  for i, value in ipairs(args) do
    busted_args[i] = value
  end
  _G.arg = busted_args
  require("busted.runner")({ standalone = false })
  return 0
end

return M
