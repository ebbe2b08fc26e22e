--- bfloat16 test data: `count` elements at `pointer` (uint16_t *) of both
--- signs, random mantissas and exponents from 2^(low - 127) over `span`
--- binades (no infinity, no NaN while low + span <= 255), from a xorshift
--- stream of seed `seed`: values an FP8 transform quantizes into every
--- part of its range.
local bit = require("bit")

local M = {}

---@param pointer ffi.cdata*
---@param count integer
---@param seed integer
---@param low integer  the smallest biased exponent
---@param span integer  how many exponents above it (a power of two)
function M.fill(pointer, count, seed, low, span)
  local state = seed
  for i = 0, count - 1 do
    state = bit.bxor(state, bit.lshift(state, 13))
    state = bit.bxor(state, bit.rshift(state, 17))
    state = bit.bxor(state, bit.lshift(state, 5))
    local exponent = low + bit.band(bit.rshift(state, 9), span - 1)
    pointer[i] = bit.bor(bit.band(state, 0x807f), bit.lshift(exponent, 7))
  end
end

return M
