--- SHA-256 (host/digest.h) of bytes held in a Lua string.
local ffi = require("ffi")
local C = require("wsync.native.ffi")

local M = {}

--- The SHA-256 of `bytes` as 64 lowercase hex characters, or nil and why.
---@param bytes string
---@return string|nil
function M.sha256_hex(bytes)
  local hex = ffi.new("char[65]")
  local status = C.ws_sha256_hex(bytes, #bytes, hex)
  if status ~= 0 then
    return nil, ffi.string(C.ws_error_detail())
  end
  return ffi.string(hex, 64)
end

return M
