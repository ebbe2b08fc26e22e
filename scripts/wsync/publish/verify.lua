--- Independent check of what a runtime holds after a publication of synthetic
--- weights: for every TP worker, the SHA-256 of each resident tensor that the
--- generator and the loader plan say it must hold, computed here from the
--- synthetic values of the full canonical tensors (no shards, no buffers, no
--- transfer), compared with the checksums the workers report.
local copy_module = require("wsync.native.copy")
local fp8 = require("wsync.native.fp8")
local synth = require("wsync.native.synth")
local errors = require("wsync.errors")
local plan_module = require("wsync.plan")
local shm = require("wsync.native.shm")

local M = {}

--- The expected resident checksums of TP rank `rank` at synthetic `step`
--- (under the plan's quantization, the slices of each group quantized
--- together on the host, wsync.native.fp8, once its last tensor is there).
---@param plan wsync.Plan
---@param tp integer
---@param rank integer
---@param step integer
---@return table<string, string>
function M.expected(plan, tp, rank, step)
  local family = plan_module.family(plan.family)
  local loader = family.loader_plan(plan.config, tp, rank, plan.quantization)
  local resident = assert(shm.anonymous(math.max(loader.bytes, 1)))
  local largest = 0
  for _, tensor in ipairs(plan.canonical) do
    largest = math.max(largest, tensor.bytes)
  end
  local scratch = assert(shm.anonymous(math.max(largest, 1)))
  -- (A group's canonical tensors, each in a scratch of its own, until the
  -- group is whole: they come one after the other in the stream.)
  local pending = {}
  local function quantize(g, copies, tensor)
    local group = pending[g] or { sources = {}, ops = {} }
    pending[g] = group
    local source = assert(shm.anonymous(math.max(tensor.bytes, 1)))
    assert(synth.fill(source, 0, tensor.source, tensor.source_offset / 2, tensor.bytes / 2, step))
    group.sources[#group.sources + 1] = source
    for _, copy in ipairs(copies) do
      group.ops[#group.ops + 1] = { group = 0, source = #group.sources - 1, target_offset = copy.dst,
        source_offset = copy.src, rows = copy.rows, columns = copy.width / 2, target_pitch = copy.dst_pitch,
        source_pitch = copy.src_pitch }
    end
    if #group.ops == loader.groups[g].slices then
      local transform = fp8.transform(#group.ops, 1)
      transform:add_group(0, loader.groups[g].scale_dst)
      for _, op in ipairs(group.ops) do
        transform:add(op)
      end
      pending[g] = nil
      local ok, message = fp8.run(resident, group.sources, transform, "expected values of " .. loader.groups[g].name)
      for _, memory in ipairs(group.sources) do
        memory:close()
      end
      assert(ok, message)
    end
  end
  local ok, err = pcall(function()
    for _, tensor in ipairs(plan.canonical) do
      local copies = loader.copies[tensor.name]
      if copies and copies[1].group then
        quantize(copies[1].group, copies, tensor)
      elseif copies then
        assert(synth.fill(scratch, 0, tensor.source, tensor.source_offset / 2, tensor.bytes / 2, step))
        local batch = copy_module.batch(#copies)
        for _, copy in ipairs(copies) do
          batch:add(copy.dst, copy.src, copy.rows, copy.width, copy.dst_pitch, copy.src_pitch)
        end
        assert(copy_module.run(resident, { pointer = scratch:pointer(), size = tensor.bytes }, batch,
          "expected values of " .. tensor.name))
      end
    end
  end)
  scratch:close()
  for _, group in pairs(pending) do
    for _, memory in ipairs(group.sources) do
      memory:close()
    end
  end
  if not ok then
    resident:close()
    error(err, 0)
  end
  local sums = {}
  for _, tensor in ipairs(loader.tensors) do
    sums[tensor.name] = assert(resident:sha256(tensor.offset, tensor.bytes))
  end
  resident:close()
  return sums
end

--- Compares every worker's reported resident checksums with the expected
--- ones. Returns {workers, tensors} checked; raises VERIFY_RESIDENT naming the
--- TP rank and tensor of the first mismatch.
---@param plan wsync.Plan
---@param tp integer
---@param step integer
---@param reported table[]  the runtime's resident_checksums().workers
function M.check(plan, tp, step, reported)
  local tensors = 0
  for rank = 0, tp - 1 do
    local expected = M.expected(plan, tp, rank, step)
    local got = reported[rank + 1] and reported[rank + 1].tensors or {}
    for _, name in ipairs(require("wsync.util").sorted_keys(expected)) do
      if got[name] ~= expected[name] then
        errors.raise("VERIFY_RESIDENT", string.format("TP worker %d holds %s with SHA-256 %s; step %d's values "
          .. "give %s", rank, name, tostring(got[name]), step, expected[name]),
          { phase = "resident check", rank = rank, tensor = name })
      end
      tensors = tensors + 1
    end
  end
  return { workers = tp, tensors = tensors }
end

--- Checks what the TP workers' own checks on the device found
--- (`resident_check`: each worker compared every slice it holds with the
--- synthetic values of `step`). Returns {workers, slices, elements}; raises
--- VERIFY_RESIDENT naming the TP rank, the slice and the element of the
--- first mismatch, or a worker that checked nothing.
---@param step integer
---@param reported table[]
function M.check_on_device(step, reported)
  local slices, elements = 0, 0
  for index, worker in ipairs(reported) do
    local rank = index - 1
    if type(worker) ~= "table" or (worker.mismatches or 0) > 0 or (worker.ops or 0) == 0 then
      local detail = type(worker) ~= "table" and "reported nothing" or (worker.ops or 0) == 0 and "checked no slice"
        or string.format("holds %d elements that are not step %d's values (the first in slice %s, element %s)",
          worker.mismatches, step, tostring(worker.op), tostring(worker.element))
      errors.raise("VERIFY_RESIDENT", string.format("TP worker %d %s", rank, detail),
        { rank = rank, phase = "resident check" })
    end
    slices, elements = slices + worker.ops, elements + worker.checked
  end
  return { workers = #reported, slices = slices, elements = elements }
end

return M
