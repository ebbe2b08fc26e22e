--- Per-worker receipts of a publication and their validation, done by the
--- runtime before it commits and by the host again after.
local errors = require("wsync.errors")

local M = {}

--- Validates the workers' receipts against the publication header: the same
--- publication id and version, every TP rank once and in order, each on the
--- device the header names, each having consumed exactly the expected
--- manifest and filled every resident tensor. Raises RECEIPT_INVALID (fatal)
--- naming the rank and the field. The host runs the same check again.
---@param header table
---@param receipts table[]
---@param resident_tensors integer[]? expected resident tensor count per rank
function M.check(header, receipts, resident_tensors)
  local function invalid(rank, message)
    errors.raise("RECEIPT_INVALID", string.format("receipt of TP rank %d: %s", rank, message),
      { fatal = true, rank = rank })
  end
  if #receipts ~= header.tp_world then
    errors.raise("RECEIPT_INVALID", string.format("%d receipts for TP %d", #receipts, header.tp_world),
      { fatal = true })
  end
  for index, receipt in ipairs(receipts) do
    local rank = index - 1
    if receipt.publication_id ~= header.publication_id then
      invalid(rank, "publication id " .. tostring(receipt.publication_id) .. " is not " .. header.publication_id)
    elseif receipt.model_version ~= header.model_version then
      invalid(rank, string.format("model version %s is not %d", tostring(receipt.model_version),
        header.model_version))
    elseif receipt.tp_rank ~= rank or receipt.tp_world ~= header.tp_world then
      invalid(rank, string.format("claims TP rank %s of %s", tostring(receipt.tp_rank), tostring(receipt.tp_world)))
    elseif receipt.uuid ~= header.uuids[index] then
      invalid(rank, string.format("device %s, the header says %s", tostring(receipt.uuid), header.uuids[index]))
    elseif receipt.manifest ~= header.manifest then
      invalid(rank, string.format("consumed manifest %s, expected %s", tostring(receipt.manifest), header.manifest))
    elseif resident_tensors and receipt.resident_tensors ~= resident_tensors[index] then
      invalid(rank, string.format("filled %s resident tensors of %d", tostring(receipt.resident_tensors),
        resident_tensors[index]))
    end
  end
end

--- Validates a runtime's answer to `finish_update` for `header` (the host's
--- check after the runtime's own): the version it committed, the reset of
--- its prefix cache, and every receipt (M.check). Raises RECEIPT_INVALID.
---@param header table
---@param result table  {model_version, prefix_cache_reset, receipts}
function M.check_finish(header, result)
  if result.model_version ~= header.model_version then
    errors.raise("RECEIPT_INVALID", string.format("the runtime committed version %s, not %d",
      tostring(result.model_version), header.model_version))
  end
  if result.prefix_cache_reset ~= true then
    errors.raise("RECEIPT_INVALID", "the runtime committed without resetting its prefix cache (cached prefixes of "
      .. "the old weights would be served)")
  end
  M.check(header, result.receipts, header.resident_tensors)
end

return M
