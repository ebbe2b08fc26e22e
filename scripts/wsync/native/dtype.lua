--- Tensor element types (host/dtype.h) by name.
local C = require("wsync.native.ffi")

local M = {}

--- The bytes of one element of dtype `name` ("bfloat16"), or nil for a name
--- the core does not know.
---@param name string
---@return integer?
function M.size(name)
  if type(name) ~= "string" then
    return nil
  end
  local size = tonumber(C.ws_dtype_size(C.ws_dtype_from_name(name, #name)))
  return size > 0 and size or nil
end

return M
