--- SHA-256 and lowercase hexadecimal (host/digest.h) of bytes held in a Lua string.
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

--- `bytes` in lowercase hexadecimal (ws_hex_encode): two characters a byte.
---@param bytes string
---@return string
function M.hex(bytes)
  local hex = ffi.new("char[?]", 2 * #bytes + 1)
  C.ws_hex_encode(bytes, #bytes, hex)
  return ffi.string(hex, 2 * #bytes)
end

--- The bytes that hexadecimal `text` (of either case, an even length) spells.
---@param text string
---@return string
function M.unhex(text)
  return (text:gsub("%x%x", function(pair)
    return string.char(tonumber(pair, 16))
  end))
end

return M
