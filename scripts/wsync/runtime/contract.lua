--- The runtime contract, stateless: what a rollout runtime checks of a
--- publication header at start_update, of its TP workers' receipts before it
--- commits, and what the host checks of a runtime's finish_update answer.
--- Every runtime applies these rules: the reference runtime and the host
--- through this module, the vllm runtime through its Python twin
--- (bindings/python/wsync/vllm/contract.py). The cases both are tested on
--- live in tests/fixtures/contract/*.json, with the code and the exact
--- message each must give, so that the two cannot drift apart.
local errors = require("wsync.errors")

local M = {}

--- How a value the contract refuses appears in its message, the same in
--- both languages: nil as "nil", a boolean as "true"/"false", an integral
--- number without a fraction, a string as it is, a table as "(a table)".
---@param value any
---@return string
function M.show(value)
  local kind = type(value)
  if kind == "number" and value % 1 == 0 and math.abs(value) < 2 ^ 53 then
    return string.format("%d", value)
  elseif kind == "number" then
    return string.format("%.17g", value)
  elseif kind == "table" or kind == "userdata" then
    return "(a table)"
  end
  return tostring(value)
end

local show = M.show

local function hex(value, digits)
  return type(value) == "string" and #value == digits and value:match("^%x+$") ~= nil
end

local function integral(value)
  return type(value) == "number" and value % 1 == 0
end

--- Checks a publication header against the runtime that receives it:
--- `runtime` is {protocol, transport, committed, tp_world, uuids}, the
--- protocol it speaks, the transport of the buffers it imported, the version
--- it committed last (0 for none), its TP world and its workers' device UUIDs
--- by rank. The header must name that protocol and transport, a 128-bit id
--- in hex, an integral version above the committed one, a SHA-256 manifest in
--- hex, that TP world and each rank's device. Raises BAD_HEADER (fatal).
---@param header any
---@param runtime {protocol: integer, transport: string, committed: integer, tp_world: integer, uuids: string[]}
function M.check_header(header, runtime)
  -- Raises BAD_HEADER with string.format(format, ...) unless `ok`.
  local function expect(ok, format, ...)
    if not ok then
      errors.raise("BAD_HEADER", string.format(format, ...), { fatal = true })
    end
  end
  expect(type(header) == "table", "start_update without a publication header")
  expect(header.protocol == runtime.protocol, "header for protocol %s; this runtime speaks %s", show(header.protocol),
    show(runtime.protocol))
  expect(header.transport == runtime.transport, "header for transport %s; the buffers this runtime imported are %s",
    show(header.transport), show(runtime.transport))
  expect(hex(header.publication_id, 32), "publication id %s is not 128 bits in hex", show(header.publication_id))
  expect(integral(header.model_version) and header.model_version > runtime.committed,
    "model version %s does not follow the committed version %s", show(header.model_version), show(runtime.committed))
  expect(hex(header.manifest, 64), "manifest %s is not a SHA-256 in hex", show(header.manifest))
  expect(type(header.uuids) == "table", "header without the ordered device UUIDs")
  expect(header.tp_world == runtime.tp_world, "header for TP %s, runtime has %s workers", show(header.tp_world),
    show(runtime.tp_world))
  for rank, uuid in ipairs(runtime.uuids) do
    expect(header.uuids[rank] == uuid, "header puts rank %d on device %s; TP worker %d is on %s", rank - 1,
      show(header.uuids[rank]), rank - 1, uuid)
  end
end

--- Checks the TP workers' receipts against the publication header: one per
--- TP rank, in order, each for this publication and version, on the device
--- the header names, having consumed exactly the expected manifest and (when
--- `resident_tensors`, the expected count per rank, is given) filled every
--- resident tensor. Raises RECEIPT_INVALID (fatal) naming the rank and the
--- field. The runtime checks before it commits; the host again after.
---@param header table
---@param receipts table[]
---@param resident_tensors integer[]?
function M.check_receipts(header, receipts, resident_tensors)
  local function invalid(rank, message)
    errors.raise("RECEIPT_INVALID", string.format("receipt of TP rank %d: %s", rank, message),
      { fatal = true, rank = rank })
  end
  if type(receipts) ~= "table" or #receipts ~= header.tp_world then
    errors.raise("RECEIPT_INVALID", string.format("%s receipts for TP %s",
      type(receipts) == "table" and show(#receipts) or "no", show(header.tp_world)), { fatal = true })
  end
  local uuids = type(header.uuids) == "table" and header.uuids or {}
  for index, receipt in ipairs(receipts) do
    local rank = index - 1
    if type(receipt) ~= "table" then
      invalid(rank, "not an object")
    elseif receipt.publication_id ~= header.publication_id then
      invalid(rank, string.format("publication id %s is not %s", show(receipt.publication_id),
        show(header.publication_id)))
    elseif receipt.model_version ~= header.model_version then
      invalid(rank, string.format("model version %s is not %s", show(receipt.model_version),
        show(header.model_version)))
    elseif receipt.tp_rank ~= rank or receipt.tp_world ~= header.tp_world then
      invalid(rank, string.format("claims TP rank %s of %s", show(receipt.tp_rank), show(receipt.tp_world)))
    elseif receipt.uuid ~= uuids[index] then
      invalid(rank, string.format("device %s, the header says %s", show(receipt.uuid), show(uuids[index])))
    elseif receipt.manifest ~= header.manifest then
      invalid(rank, string.format("consumed manifest %s, expected %s", show(receipt.manifest), show(header.manifest)))
    elseif resident_tensors and receipt.resident_tensors ~= resident_tensors[index] then
      invalid(rank, string.format("filled %s resident tensors of %s", show(receipt.resident_tensors),
        show(resident_tensors[index])))
    end
  end
end

--- Checks a runtime's answer to finish_update for `header` (the host's check
--- after the runtime's own): the version it committed, the reset of its
--- prefix cache (or the salt that does its work: no cached prefix of the old
--- weights is served), and every receipt (M.check_receipts against the
--- header's resident counts). Raises RECEIPT_INVALID.
---@param header table
---@param result table  {model_version, prefix_cache_reset, receipts}
function M.check_finish(header, result)
  if result.model_version ~= header.model_version then
    errors.raise("RECEIPT_INVALID", string.format("the runtime committed version %s, not %s",
      show(result.model_version), show(header.model_version)))
  end
  if result.prefix_cache_reset ~= true then
    errors.raise("RECEIPT_INVALID", "the runtime committed without resetting its prefix cache (cached prefixes of "
      .. "the old weights would be served)")
  end
  M.check_receipts(header, result.receipts, header.resident_tensors)
end

return M
