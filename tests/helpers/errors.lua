--- Test helper: the wsync error a call raises.
local errors = require("wsync.errors")

local M = {}

--- Runs `fn(...)`, asserts that it raised a wsync error object and returns it.
---@param fn function
---@return wsync.Error
function M.error_of(fn, ...)
  local ok, err = pcall(fn, ...)
  -- (busted's assert.* is given to specs, not to the modules they require)
  assert(not ok, "expected an error")
  assert(errors.is(err), "not a wsync error: " .. tostring(err))
  return err
end

return M
