--- The publication plan, made from metadata before any tensor exists: the
--- trainer tensors in layout order, the chunks they are packed into (slots:
--- each a trainer tensor's rows, back to back, no padding, each chunk filled
--- up to the buffer size; a tensor goes on in the next chunk at a row where
--- no canonical tensor goes on, such as a packed expert's boundary), the
--- canonical tensors each chunk carries with their offsets in the buffer, the
--- expected manifest, and the memory a device needs. Under a quantization
--- (the rollout's, `model.quantization`), the runs of tensors the family
--- couples (family.coupled: tensors under one scale) start a chunk of their
--- own when the current one cannot hold them whole.
local errors = require("wsync.errors")
local manifest = require("wsync.native.manifest")

local M = {}

--- Model families wsync has plans for.
M.families = {
  qwen3_moe = "wsync.plan.qwen3_moe",
}

--- Loads a model family's plan module.
---@param family string
function M.family(family)
  local module = M.families[family]
  if not module then
    errors.raise("MODEL_UNSUPPORTED", string.format("unknown model family '%s' (known: %s)", tostring(family),
      table.concat(require("wsync.util").sorted_keys(M.families), ", ")))
  end
  return require(module)
end

local function format_bytes(bytes)
  local units = { "B", "KiB", "MiB", "GiB", "TiB" }
  local unit = 1
  while bytes >= 1024 and unit < #units do
    bytes, unit = bytes / 1024, unit + 1
  end
  return unit == 1 and string.format("%d B", bytes) or string.format("%.2f %s", bytes, units[unit])
end
M.format_bytes = format_bytes

---@class wsync.Chunk
---@field index integer        1-based chunk number
---@field slots table[]        {index (in layout), name, offset, bytes, rows = {first, count}}
---@field tensors table[]      canonical {name, dtype, shape, bytes, offset (in the buffer)}
---@field bytes integer

---@class wsync.Plan
---@field family string
---@field config table
---@field layout table[]       trainer tensors in layout order
---@field canonical table[]    canonical tensors in stream order
---@field chunks wsync.Chunk[]
---@field buffer_bytes integer
---@field buffer_count integer
---@field bytes integer        canonical bytes (= trainer bytes)
---@field largest table        the largest trainer tensor {name, bytes}
---@field manifest string      expected manifest (from the config alone)

-- The rows of a trainer tensor a chunk may end at (`cuts[row]` true): where
-- one of the canonical tensors of its export (`records`, byte offsets in it)
-- starts on a row's boundary and none before it goes on past that row.
local function cuts(records, row_bytes)
  local ordered = {}
  for index, record in ipairs(records) do
    ordered[index] = record
  end
  table.sort(ordered, function(a, b)
    return a.offset < b.offset
  end)
  local cuttable, reach = {}, 0
  for _, record in ipairs(ordered) do
    if record.offset > 0 and record.offset >= reach and record.offset % row_bytes == 0 then
      cuttable[record.offset / row_bytes] = true
    end
    reach = math.max(reach, record.offset + record.bytes)
  end
  return cuttable
end

--- Builds the plan for `model` ({family, config, quantization?}) and buffers ({bytes,
--- count, direct}). Raises PLAN_INVALID naming the tensor whose smallest
--- piece does not fit a buffer. `direct` (one rank): one chunk of every tensor, read where the
--- trainer holds it, and no packed buffers (`buffer_bytes` 0).
---@param model {family: string, config: table, quantization: string?}
---@param buffers {bytes: integer, count: integer, direct: boolean?, order: string?}
---@return wsync.Plan
function M.build(model, buffers)
  if buffers.direct then
    local plan = M.build(model, { bytes = math.huge, count = 1 })
    plan.direct, plan.buffer_bytes = true, 0
    return plan
  end
  local family = M.family(model.family)
  local config = family.config(model.config)
  local layout = family.trainer_layout(config)
  local plan = {
    family = model.family,
    config = config,
    layout = layout,
    canonical = {},
    chunks = {},
    buffer_bytes = buffers.bytes,
    buffer_count = buffers.count,
    quantization = model.quantization,
    ordered = buffers.order == "device" or nil, -- (the device orders each chunk's fill and load)
    bytes = 0,
    largest = { name = nil, bytes = 0 },
  }
  local current = nil
  local function open_chunk()
    current = { index = #plan.chunks + 1, slots = {}, tensors = {}, bytes = 0 }
    plan.chunks[#plan.chunks + 1] = current
  end
  local coupled = family.coupled and family.coupled(layout, model.quantization) or {}
  for index, tensor in ipairs(layout) do
    local run_end = coupled[index]
    if run_end then
      local run = 0
      for member = index, run_end do
        run = run + layout[member].bytes
      end
      if run > buffers.bytes then
        errors.raise("PLAN_INVALID", string.format("tensors %s to %s share one %s scale and come in one chunk: %d "
          .. "bytes (%s); the buffer holds %d (%s): raise buffers.bytes", tensor.name, layout[run_end].name,
          model.quantization, run, format_bytes(run), buffers.bytes, format_bytes(buffers.bytes)),
          { field = "buffers.bytes", tensor = tensor.name })
      end
      if current and current.bytes > 0 and buffers.bytes - current.bytes < run then
        open_chunk()
      end
    end
    if tensor.bytes > plan.largest.bytes then
      plan.largest = { name = tensor.name, bytes = tensor.bytes }
    end
    local records = family.export(tensor.name, tensor.shape)
    local rows = tensor.shape[1]
    local row_bytes = tensor.bytes / rows
    local cuttable = cuts(records, row_bytes)
    -- Rows [row, rows) still to place: as many as fit the current chunk, ending
    -- where no canonical tensor goes on (or at the tensor's end); a piece
    -- that fits no empty buffer is refused.
    local row = 0
    while row < rows do
      local space = current and (buffers.bytes - current.bytes) or 0
      local last = math.min(rows, row + math.floor(space / row_bytes))
      while last > row and last < rows and not cuttable[last] do
        last = last - 1
      end
      if last == row then
        if current and current.bytes == 0 then
          local need = rows
          for cut = row + 1, rows - 1 do
            if cuttable[cut] then
              need = cut
              break
            end
          end
          local bytes = (need - row) * row_bytes
          errors.raise("PLAN_INVALID", string.format("tensor %s needs %d bytes (%s) in one piece%s; the buffer holds "
            .. "%d (%s): raise buffers.bytes", tensor.name, bytes, format_bytes(bytes),
            need - row < rows and string.format(" (rows %d to %d of %d)", row, need - 1, rows) or "",
            buffers.bytes, format_bytes(buffers.bytes)), { field = "buffers.bytes", tensor = tensor.name })
        end
        open_chunk()
      else
        local first_byte, end_byte = row * row_bytes, last * row_bytes
        local slot = { index = index, name = tensor.name, offset = current.bytes, bytes = end_byte - first_byte,
          shape = tensor.shape, dtype = tensor.dtype, rows = { row, last - row } }
        current.slots[#current.slots + 1] = slot
        for _, canonical in ipairs(records) do
          if canonical.offset >= first_byte and canonical.offset < end_byte then
            local placed = {
              name = canonical.name, dtype = canonical.dtype, shape = canonical.shape, bytes = canonical.bytes,
              offset = slot.offset + canonical.offset - first_byte, source = tensor.name,
              source_offset = canonical.offset,
            }
            current.tensors[#current.tensors + 1] = placed
            plan.canonical[#plan.canonical + 1] = placed
          end
        end
        current.bytes = current.bytes + slot.bytes
        row = last
      end
    end
    plan.bytes = plan.bytes + tensor.bytes
  end
  plan.manifest = manifest.of(plan.canonical).digest
  return plan
end

--- A summary for `wsync check` and reports.
---@param plan wsync.Plan
function M.summary(plan)
  return {
    family = plan.family,
    tensors = #plan.canonical,
    trainer_tensors = #plan.layout,
    bytes = plan.bytes,
    chunks = #plan.chunks,
    buffer_bytes = plan.buffer_bytes,
    buffers = plan.buffer_count,
    largest_tensor = plan.largest.name,
    largest_tensor_bytes = plan.largest.bytes,
    manifest = plan.manifest,
  }
end

return M
