--- Test helper: manifests computed straight through the C core (LuaJIT FFI),
--- so that specs and child processes hash the same records the same way.
local ffi = require("ffi")
local C = require("wsync.native.ffi")

local M = {}

--- A small, varied record list: several dtypes, a scalar, a zero-sized
--- dimension and a non-ASCII name.
M.sample = {
  { "model.embed_tokens.weight", "bfloat16", { 1024, 64 } },
  { "model.layers.0.self_attn.q_proj.weight", "bfloat16", { 128, 64 } },
  { "model.layers.0.mlp.gate.weight", "float32", { 8, 64 } },
  { "model.layers.0.mlp.experts.0.down_proj.weight", "float8_e4m3fn", { 64, 32 } },
  { "scale", "float64", {} },
  { "empty.rows", "int32", { 0, 7 } },
  { "名前.weight", "int64", { 3, 1, 2 } },
}

--- The dtype enum for a name, or the value itself when it is a number.
function M.dtype(name)
  if type(name) ~= "string" then
    return name
  end
  return C.ws_dtype_from_name(name, #name)
end

--- Starts a manifest; the caller frees it with C.ws_manifest_free.
function M.new()
  local out = ffi.new("ws_manifest *[1]")
  local status = C.ws_manifest_new(out)
  assert(status == 0, "ws_manifest_new failed: " .. ffi.string(C.ws_error_detail()))
  return out[0]
end

--- Adds one record `{name, dtype, shape}`; returns the core's status. The
--- record's optional fourth entry overrides the dimension count.
function M.add(manifest, record)
  local name, shape = record[1], record[3]
  local dims = record[4] or #shape
  local shape_array = ffi.new("int64_t[?]", math.max(#shape, 1))
  for i, value in ipairs(shape) do
    shape_array[i - 1] = value
  end
  return C.ws_manifest_add(manifest, name, #name, M.dtype(record[2]), shape_array, dims)
end

--- Finishes a manifest; returns its status and hex digest.
function M.finish(manifest)
  local hex = ffi.new("char[?]", C.WS_MANIFEST_HEX_LENGTH + 1)
  local status = C.ws_manifest_finish(manifest, hex)
  return status, ffi.string(hex)
end

--- The digest of a record list (raises when the core refuses a record).
---@param records table[]
---@return string digest, integer count, number bytes
function M.digest(records)
  local manifest = M.new()
  for index, record in ipairs(records) do
    local status = M.add(manifest, record)
    if status ~= 0 then
      local detail = ffi.string(C.ws_error_detail())
      C.ws_manifest_free(manifest)
      error(string.format("record %d: %s", index, detail), 2)
    end
  end
  local status, digest = M.finish(manifest)
  local count = tonumber(C.ws_manifest_count(manifest))
  local bytes = tonumber(C.ws_manifest_bytes(manifest))
  C.ws_manifest_free(manifest)
  assert(status == 0, "ws_manifest_finish failed")
  return digest, count, bytes
end

return M
