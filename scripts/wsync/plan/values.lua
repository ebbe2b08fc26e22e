--- The check of a publication against the trainer's own values (recipe
--- `verify = "values"`): every resident tensor of every TP worker gets a sum
--- of its elements' values (wsync.native.values: position-weighted, composable
--- over any split of the elements). A TP worker sums what it holds; each
--- trainer rank sums, for every worker's resident tensor, the elements of its
--- own dim-0 rows that the loader plan puts there; the host adds the ranks'
--- sums and compares. No tensor crosses a process for it.
local dtype_module = require("wsync.native.dtype")
local errors = require("wsync.errors")
local values = require("wsync.native.values")

local M = {}

-- The resident tensors of a loader plan by name, each with its slot.
local function slots_of(loader)
  local slots, names = {}, {}
  for index, tensor in ipairs(loader.tensors) do
    slots[tensor.name] = { index = index, tensor = tensor, seed = values.seed(tensor.name),
      element = assert(dtype_module.size(tensor.dtype)) }
    names[index] = tensor.name
  end
  return slots, names
end

-- Canonical names of a loader plan's copies, sorted (a stable order).
local function sorted_canonicals(loader)
  return require("wsync.util").sorted_keys(loader.copies)
end

local function term_op(copy, slot, first, pitch, bias, lo, hi)
  return {
    bias = bias, first = first, rows = copy.rows, width = copy.width, pitch = pitch, lo = lo, hi = hi,
    index_first = (copy.dst - slot.tensor.offset) / slot.element, index_pitch = copy.dst_pitch / slot.element,
    seed = slot.seed, slot = slot.index,
  }
end

-- Turns sums[0..n) into {name = hex}.
local function named(sums, names)
  local out = {}
  for index, name in ipairs(names) do
    out[name] = values.hex(sums[index - 1])
  end
  return out
end

--- What a TP worker holds: the sum of every resident tensor over the bytes
--- the loader plan's copies fill, read from `memory` (the worker's resident
--- storage, as wsync.native.copy takes it). Returns {name = hex}; raises
--- VALUES_FAILED.
---@param loader table  the worker's loader plan (family.loader_plan)
---@param memory any
---@return table<string, string>
function M.resident(loader, memory)
  local slots, names = slots_of(loader)
  local by_element = {}
  for _, canonical in ipairs(sorted_canonicals(loader)) do
    for _, copy in ipairs(loader.copies[canonical]) do
      local slot = slots[copy.resident]
      local ops = by_element[slot.element] or {}
      by_element[slot.element] = ops
      ops[#ops + 1] = term_op(copy, slot, copy.dst, copy.dst_pitch, 0, 0, loader.bytes)
    end
  end
  local sums = values.slots(#names)
  for element, ops in pairs(by_element) do
    local ok, message = values.add(memory, element, ops, sums, #names)
    if not ok then
      errors.raise("VALUES_FAILED", "summing resident values: " .. tostring(message))
    end
  end
  return named(sums, names)
end

--- What one trainer rank's rows add to every resident tensor of a worker.
--- `plan` is the publication's plan (its canonical tensors say which trainer
--- tensor each comes from and where), `shards` the rank's registered tensors
--- by name ({rows = {first, count}, row_bytes, offset, source}) and `memories`
--- its memories (by `source`). Returns {name = hex}; raises VALUES_FAILED.
---@param loader table
---@param plan table
---@param shards table<string, table>
---@param memories any[]
---@return table<string, string>
function M.trainer(loader, plan, shards, memories)
  local slots, names = slots_of(loader)
  local canonical_by_name = {}
  for _, tensor in ipairs(plan.canonical) do
    canonical_by_name[tensor.name] = tensor
  end
  -- ops by memory, then element size
  local by_memory = {}
  for _, name in ipairs(sorted_canonicals(loader)) do
    local canonical = canonical_by_name[name]
    local shard = canonical and shards[canonical.source]
    if not shard then
      errors.raise("VALUES_FAILED", string.format("the plan's %s comes from %s, which this rank did not register",
        name, canonical and canonical.source or "no trainer tensor"))
    end
    -- The rank holds trainer bytes [have_lo, have_hi); the canonical tensor
    -- is trainer bytes [source_offset, + bytes).
    local have_lo = shard.rows[1] * shard.row_bytes
    local have_hi = have_lo + shard.rows[2] * shard.row_bytes
    local lo = math.max(0, have_lo - canonical.source_offset)
    local hi = math.min(canonical.bytes, have_hi - canonical.source_offset)
    if lo < hi then
      local bias = shard.offset - have_lo + canonical.source_offset
      for _, copy in ipairs(loader.copies[name]) do
        local slot = slots[copy.resident]
        local per_element = by_memory[shard.source] or {}
        by_memory[shard.source] = per_element
        local ops = per_element[slot.element] or {}
        per_element[slot.element] = ops
        ops[#ops + 1] = term_op(copy, slot, copy.src, copy.src_pitch, bias, lo, hi)
      end
    end
  end
  local sums = values.slots(#names)
  for source, per_element in pairs(by_memory) do
    for element, ops in pairs(per_element) do
      local ok, message = values.add(memories[source], element, ops, sums, #names)
      if not ok then
        errors.raise("VALUES_FAILED", "summing this rank's values: " .. tostring(message))
      end
    end
  end
  return named(sums, names)
end

--- Compares every worker's sums (`reported`: {rank, tensors = {name = hex}})
--- with the ranks' (`ranks[r + 1][w + 1]`: {name = hex} of rank r for worker
--- w). Returns {workers, tensors}; raises VERIFY_RESIDENT naming the TP rank
--- and tensor of the first mismatch.
---@param loaders table[]  by worker, 1-based
---@param ranks table[]
---@param reported table[]
function M.check(loaders, ranks, reported)
  local checked = 0
  for w, loader in ipairs(loaders) do
    local worker = nil
    for _, entry in ipairs(reported) do
      if entry.rank == w - 1 then
        worker = entry
      end
    end
    if not worker then
      errors.raise("VERIFY_RESIDENT", string.format("TP worker %d reported no resident sums", w - 1),
        { rank = w - 1 })
    end
    for _, tensor in ipairs(loader.tensors) do
      local parts = {}
      for r, sums in ipairs(ranks) do
        local part = sums[w] and sums[w][tensor.name]
        if part == nil then
          errors.raise("VERIFY_RESIDENT", string.format("trainer rank %d sent no sum of TP worker %d's %s", r - 1,
            w - 1, tensor.name), { rank = r - 1 })
        end
        parts[#parts + 1] = part
      end
      local expected = values.add_hex(parts)
      local got = worker.tensors[tensor.name]
      if expected == nil then
        errors.raise("VERIFY_RESIDENT", string.format("a trainer rank's sum of %s is not 16 hex digits",
          tensor.name))
      end
      if got ~= expected then
        errors.raise("VERIFY_RESIDENT", string.format("TP worker %d holds %s with values sum %s; the trainer "
          .. "ranks' values give %s", w - 1, tensor.name, tostring(got), expected),
          { rank = w - 1, phase = "resident check" })
      end
      checked = checked + 1
    end
  end
  return { workers = #loaders, tensors = checked }
end

return M
