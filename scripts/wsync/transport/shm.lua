--- The `shm` transport, the host backend's data plane: packed buffers are
--- POSIX shared-memory segments that every trainer rank and the TP worker of
--- the same rank map; the all-gather of shards is each rank copying its rows
--- into every rank's buffer; a TP worker's load is a batch of strided copies
--- from its rank's buffer into resident memory (private anonymous memory, the
--- "device" of the host backend).
---
--- Segments are named (/dev/shm/wsync-<creator pid>-...) rather than memfds
--- passed over the control sockets: the runtime's workers are reached through
--- their main process over pipes, and passing descriptors there would need
--- SCM_RIGHTS through two hops that luv's pipes do not carry; a name also lets
--- a new process map a buffer by itself. What a crash leaves behind is found
--- by the creator's pid in the name (M.remove_leftovers).
---
--- Interface (shared with the cuda transport; wsync.transport picks one;
--- `context` is {device, world, rank, nccl_id, roots}, what a transport
--- needs beyond the arguments, ignored here):
---   agent side:   create(count, bytes, context) -> own buffers;
---                 descriptors(own); attach(own, descriptors by rank, rank,
---                 context) -> targets; plan_fill(targets, slot, sources,
---                 spans, context) -> fill plan; close_plan(plan);
---                 fill(targets, slot, sources, plan); release(own, targets)
---   runtime side: import(descriptors, context) -> imported;
---                 plan_load(resident, buffer, copies, transform?) -> load
---                 plan (`transform`: quantized slices, or nil);
---                 load(resident, buffer, plan); close_imported(imported);
---                 allocate(bytes, what, context); checksum(memory, offset,
---                 bytes)
---   cleanup:      remove_leftovers(descriptors, pids)
--- `BINDS_MEMORY`: whether a plan holds the addresses of the memory it was
--- made for (then a plan is made again when that memory is reallocated).
local uv = require("luv")
local copy = require("wsync.native.copy")
local fp8 = require("wsync.native.fp8")
local shm = require("wsync.native.shm")
local util = require("wsync.util")

local M = {}

--- The name a publication header gives this transport.
M.NAME = "shm"

--- What it has beyond the interface (wsync.transport.CAPABILITIES): names in
--- /dev/shm that a process killed with SIGKILL leaves behind.
M.CAPABILITIES = { named_leftovers = true }

-- True for a list of memories (resident parameters of another engine), as
-- opposed to one memory.
local function is_list(memory)
  return type(memory) == "table" and memory[1] ~= nil
end

--- Plans here are offsets only: they fit any memory of the right size.
M.BINDS_MEMORY = false


--- How the ranks' shards come together: each rank writes its rows into
--- every rank's buffer through shared memory.
M.GATHER = "shared"

---@class wsync.ShmOwn
---@field buffers userdata[]  this rank's packed buffers, by slot

--- Creates this rank's `count` packed buffers of `bytes` bytes. Returns them,
--- or nil, message, code (the buffers made so far are closed).
---@param count integer
---@param bytes integer
---@return wsync.ShmOwn|nil, string?, string?
function M.create(count, bytes)
  local own = { buffers = {} }
  for slot = 1, count do
    local buffer, message, code = shm.create(bytes)
    if not buffer then
      M.release(own)
      return nil, string.format("packed buffer %d (%d bytes): %s", slot, bytes, message), code
    end
    own.buffers[slot] = buffer
  end
  return own
end

--- What other processes need to map `own`'s buffers (by slot).
---@param own wsync.ShmOwn
---@return string[]
function M.descriptors(own)
  local names = {}
  for slot, buffer in ipairs(own.buffers) do
    names[slot] = buffer:name()
  end
  return names
end

---@class wsync.ShmTargets
---@field mapped userdata[]            other ranks' buffers this rank mapped
---@field by_slot wsync.CopyEnds[]     every rank's buffer of a slot, rank order

--- Maps every other rank's buffers (`descriptors[rank + 1][slot]`) next to
--- this rank's own: the targets of this rank's fills. Returns them, or nil,
--- message, code (what was mapped is closed).
---@param own wsync.ShmOwn
---@param descriptors string[][]
---@param rank integer
function M.attach(own, descriptors, rank)
  local targets = { mapped = {}, by_slot = {} }
  local per_slot = {}
  for index, names in ipairs(descriptors) do
    for slot, name in ipairs(names) do
      local buffer = own.buffers[slot]
      if index - 1 ~= rank then
        local message, code
        buffer, message, code = shm.open(name)
        if not buffer then
          M.release(nil, targets)
          return nil, string.format("rank %d's buffer %s: %s", index - 1, name, message), code
        end
        targets.mapped[#targets.mapped + 1] = buffer
      end
      per_slot[slot] = per_slot[slot] or {}
      per_slot[slot][index] = buffer
    end
  end
  for slot, buffers in ipairs(per_slot) do
    targets.by_slot[slot] = copy.ends(buffers)
  end
  return targets
end

--- What a fill reads from: the rank's memories as copy ends (pointers and
--- sizes, taken now).
function M.sources(memories)
  return copy.ends(memories)
end

--- `memory` as host memory the values check reads (wsync.plan.values): the
--- memory itself.
function M.host_copy(memory)
  return memory
end

--- The NCCL unique id: the shm transport gathers through shared memory.
function M.nccl_id()
  return nil, "the shm transport needs no NCCL", "WS_EINVAL"
end

--- A chunk's fill, planned once: `spans` are this rank's pieces of the
--- chunk, `{target_offset, source, source_offset, bytes}` (source: the index
--- of the rank's memory, 1-based), each written at the same offset of every
--- rank's buffer slot.
---@param spans table[]
---@return wsync.CopyBatch
function M.plan_fill(_, _, _, spans)
  local batch = copy.batch(#spans)
  for _, span in ipairs(spans) do
    batch:add(span.target_offset, span.source_offset, 1, span.bytes, span.bytes, span.bytes, span.source - 1)
  end
  return batch
end

--- Forgets a plan (nothing to free here).
function M.close_plan()
end

--- Runs a fill plan into buffer `slot` of every rank, reading `sources` (the
--- rank's memories, from wsync.native.copy.ends). Returns the bytes written
--- and the seconds the copy took, or nil, message, code.
function M.fill(targets, slot, sources, plan, what)
  local ends = targets.by_slot[slot]
  if not ends then
    return nil, string.format("%s: buffer %s is not mapped", what or "fill", tostring(slot)), "WS_EINVAL"
  end
  local started = uv.hrtime()
  local bytes, message, code = copy.run_sources(ends, sources, plan, what)
  if not bytes then
    return nil, message, code
  end
  return bytes, (uv.hrtime() - started) / 1e9
end

--- Unmaps and frees what an agent holds: its own buffers (their names are
--- removed) and its mappings of the other ranks' buffers. Either may be nil.
function M.release(own, targets)
  for _, buffer in ipairs(targets and targets.mapped or {}) do
    buffer:close()
  end
  for _, buffer in ipairs(own and own.buffers or {}) do
    buffer:close()
  end
end

--- Maps the packed buffers a TP worker loads from (`descriptors` by slot),
--- once for as long as the runtime lives. Returns them by slot, or nil,
--- message, code (what was mapped is closed).
---@param descriptors string[]
function M.import(descriptors)
  local imported = {}
  for slot, name in ipairs(descriptors) do
    local buffer, message, code = shm.open(name)
    if not buffer then
      M.close_imported(imported)
      return nil, string.format("buffer %s: %s", name, message), code
    end
    imported[slot] = buffer
  end
  return imported
end

--- Unmaps imported buffers.
M.close_imported = require("wsync.transport").close_imported

--- A chunk's loads for one TP worker, planned once: `copies` are
--- `{target_offset, source_offset, rows, width, target_pitch, source_pitch}`
--- from the imported buffer into resident memory. With `resident` a list of
--- memories (a worker over another engine's parameters), each copy names its
--- `target` (1-based) in it: one batch per target. `transform` (the loader's
--- quantized slices, wsync.runtime.loader's transform_of; nil: none) runs
--- after the copies, on the host (wsync.native.fp8).
---@param resident any
---@param copies table[]
---@param transform table?
---@return table plan
function M.plan_load(resident, buffer, copies, transform)
  if transform then
    local quantize = fp8.transform(#transform.ops, #transform.groups)
    for _, group in ipairs(transform.groups) do
      quantize:add_group((group.target or 1) - 1, group.scale_offset)
    end
    for _, op in ipairs(transform.ops) do
      quantize:add({ group = op.group - 1, target = (op.target or 1) - 1, source = (op.source or 1) - 1,
        target_offset = op.target_offset, source_offset = op.source_offset, rows = op.rows, columns = op.columns,
        target_pitch = op.target_pitch, source_pitch = op.source_pitch })
    end
    return { copies = M.plan_load(resident, buffer, copies), fp8 = quantize }
  end
  if not is_list(resident) then
    local batch = copy.batch(#copies)
    for _, c in ipairs(copies) do
      batch:add(c.target_offset, c.source_offset, c.rows, c.width, c.target_pitch, c.source_pitch)
    end
    return batch
  end
  local by_target, order = {}, {}
  for _, c in ipairs(copies) do
    local batch = by_target[c.target]
    if not batch then
      batch = copy.batch(4)
      by_target[c.target] = batch
      order[#order + 1] = c.target
    end
    batch:add(c.target_offset, c.source_offset, c.rows, c.width, c.target_pitch, c.source_pitch)
  end
  return { targets = order, batches = by_target }
end

--- Runs a load plan from `buffer` (imported) into `resident`. Returns the
--- bytes moved (written, for a transform) and the seconds the copy took, or
--- nil, message, code.
function M.load(resident, buffer, plan, what)
  local started = uv.hrtime()
  if plan.fp8 then
    local copied, message, code = M.load(resident, buffer, plan.copies, what)
    if not copied then
      return nil, message, code
    end
    local written
    written, message, code = fp8.run(resident, buffer, plan.fp8, what)
    if not written then
      return nil, message, code
    end
    return copied + written, (uv.hrtime() - started) / 1e9
  end
  local bytes = 0
  if plan.targets then
    for _, target in ipairs(plan.targets) do
      local moved, message, code = copy.run(resident[target], buffer, plan.batches[target], what)
      if not moved then
        return nil, message, code
      end
      bytes = bytes + moved
    end
  else
    local message, code
    bytes, message, code = copy.run(resident, buffer, plan, what)
    if not bytes then
      return nil, message, code
    end
  end
  return bytes, (uv.hrtime() - started) / 1e9
end

--- Allocates `bytes` of resident memory (weights, KV arena) with its pages
--- faulted in, as a device allocation is backed at once. Returns it (close()
--- frees it), or nil, message, code.
---@param bytes integer
---@param what string
function M.allocate(bytes, what)
  local memory, message, code = shm.anonymous(math.max(bytes, 1))
  if not memory then
    return nil, string.format("cannot allocate %d bytes of %s: %s", bytes, what, message), code or "WS_ENOMEM"
  end
  local ok
  ok, message, code = copy.prefault(memory, what)
  if not ok then
    memory:close()
    return nil, string.format("cannot back %d bytes of %s: %s", bytes, what, message), code
  end
  return memory
end

--- Copies all of device memory `memory` into host memory `host` (a
--- wsync.native.shm buffer of at least its size), or back with `back`.
--- Returns true, or nil and why.
function M.copy_host(memory, host, back)
  local ok, message
  if back then
    ok, message = memory:copy_from(host, 0, 0, memory:size())
  else
    ok, message = host:copy_from(memory, 0, 0, memory:size())
  end
  return ok, message
end

--- Fills `memory` with the bytes of `pattern` over and over (the dummy
--- weights a runtime starts with).
function M.fill_pattern(memory, pattern)
  local size = memory:size()
  for offset = 0, size - 1, #pattern do
    memory:write(offset, pattern:sub(1, math.min(#pattern, size - offset)))
  end
  return true
end

--- The SHA-256 of `bytes` of `memory` from `offset`.
function M.checksum(memory, offset, bytes)
  return memory:sha256(offset, bytes)
end

-- A wsync segment's name in /dev/shm (its capture: the creator's pid).
local SEGMENT = "^wsync%-(%d+)%-%x+$"

--- Removes the segments in /dev/shm that processes of this user left when
--- they died without removing them (a host or a trainer killed with
--- SIGKILL): `wsync-<pid>-<16 hex digits>` files of this user whose pid is
--- gone. `report(line)` hears each removal. Returns the names removed.
---@param report fun(line: string)?
---@return string[]
function M.remove_dead_segments(report)
  local removed = {}
  for _, path, pid, stat in util.leftovers("/dev/shm", SEGMENT) do
    if stat.type == "file" and uv.fs_unlink(path) then
      removed[#removed + 1] = path
      if report then
        report(string.format("removed %s, left by pid %d, which is gone (%d bytes)", path, pid, stat.size))
      end
    end
  end
  return removed
end

--- Removes the names of packed buffers that their creators can no longer
--- remove: those in `descriptors` (lists of names), and every segment named
--- for a process in `pids` ({[pid] = true}: ranks that died before they could
--- say their names). A mapping that still exists stays valid. The names are
--- unlinked without opening them: a rank killed between creating a name and
--- sizing it leaves an empty segment, which no open accepts. Returns the
--- names removed and the failures ({name, message}).
---@param descriptors string[][]
---@param pids table<integer, boolean>
---@return string[] removed, table[] failures
function M.remove_leftovers(descriptors, pids)
  local names, seen = {}, {}
  for _, list in pairs(descriptors or {}) do
    for _, name in ipairs(list) do
      util.append_unseen(names, seen, name)
    end
  end
  if next(pids or {}) then
    for entry, pid in util.named_entries("/dev/shm", SEGMENT) do
      if pids[pid] then
        util.append_unseen(names, seen, "/" .. entry)
      end
    end
  end
  local removed, failures = {}, {}
  for _, name in ipairs(names) do
    local ok, message, code = uv.fs_unlink("/dev/shm/" .. name:gsub("^/", ""))
    if ok then
      removed[#removed + 1] = name
    elseif code ~= "ENOENT" then
      failures[#failures + 1] = { name = name, message = tostring(message) }
    end
  end
  return removed, failures
end

return M
