--- Whether this build and this machine can serve a model recipe, asked
--- before anything starts (`wsync run`, and `wsync check` unless
--- --plan-only): its runtime kind and that runtime on its backend
--- (M.RUNTIMES), a usable GPU for each rank on cuda, the TCP endpoint's
--- token, the unix socket's path, RLIMIT_NPROC and RLIMIT_NOFILE, and on the
--- host backend /dev/shm and the memory the run would hold. It reads limits
--- and counts devices only: it allocates and starts nothing. Refusals are
--- RECIPE_INVALID naming the recipe's field (wsync.recipe.location).
local location = require("wsync.recipe.location")
local token = require("wsync.recipe.token")
local util = require("wsync.util")

local M = {}

local read_file, refuse = util.read_file, location.refuse

--- The rollout runtimes this build has: the backends each one's TP workers
--- hold weights on, and whether it generates. A runtime added to the build
--- is added here (and to wsync.runtime.spawn): `check` and `run` refuse any
--- other, and what a runtime cannot do.
M.RUNTIMES = {
  -- (It generates with a toy decoder: wsync.runtime.decoder.)
  reference = { backends = { host = true, cuda = require("wsync").cuda_built or nil }, generates = true },
  -- (Its Python side, and vLLM there, are looked for by `probe`.)
  -- On the host backend only with an engine in place of vLLM
  -- ($WSYNC_VLLM_ENGINE; vLLM itself runs on cuda).
  vllm = { backends = { cuda = require("wsync").cuda_built or nil, host = true }, generates = true,
    probe = function(recipe)
      return require("wsync.runtime.vllm").unavailable(recipe)
    end },
}

-- What the CUDA runtime's error names mean for a person, when it cannot
-- count the GPUs.
local CUDA_COUNT_ERRORS = {
  cudaErrorInsufficientDriver = "no NVIDIA driver is loaded, or one too old for the CUDA %s runtime this wsync was "
    .. "built with",
  cudaErrorNoDevice = "the NVIDIA driver sees no GPU (CUDA_VISIBLE_DEVICES may hide them)",
}

--- Why the cuda backend cannot run here, in plain words: this build has no
--- CUDA, or this machine no usable GPU (and why, with CUDA's own words after
--- it). `reason` is what counting the devices answered (nil: it counted 0).
---@param reason string?
---@return string
function M.no_gpu(reason)
  local build = require("wsync").build
  if not build.cuda then
    return "backend 'cuda': this wsync was built without CUDA (no CUDA toolkit when it was built): it runs the host "
      .. "backend only"
  end
  local name = reason and reason:match("(cudaError%w+)")
  local plain = name and CUDA_COUNT_ERRORS[name]
  if plain then
    return string.format("backend 'cuda': this machine has no usable GPU: %s (CUDA says %s)",
      string.format(plain, tostring(build.cuda_toolkit)), name)
  end
  return string.format("backend 'cuda': this machine has no usable GPU (%s)", tostring(reason
    or "the CUDA runtime sees 0 devices"))
end

--- Why this build or machine cannot serve a model recipe: its runtime kind,
--- that runtime on its backend, no usable GPU (or fewer than the ranks) for
--- the cuda backend, or a schedule step the runtime cannot run. The message
--- and the field; nil when it can.
---@param recipe table  validated, with a model
---@return string? message, string? field
function M.unserved(recipe)
  local kind, backend = recipe.runtime.kind, recipe.backend
  local runtime = M.RUNTIMES[kind]
  local sorted_keys = util.sorted_keys
  if not runtime then
    local has = {}
    for _, name in ipairs(sorted_keys(M.RUNTIMES)) do
      has[#has + 1] = string.format("%s, on the %s backend", name,
        table.concat(sorted_keys(M.RUNTIMES[name].backends), " and "))
    end
    return string.format("runtime.kind '%s' is not in this build (this build has: %s)", kind,
      table.concat(has, "; ")), "runtime.kind"
  end
  if not runtime.backends[backend] then
    return string.format("backend '%s': this build's %s runtime holds weights on the %s backend only", backend, kind,
      table.concat(sorted_keys(runtime.backends), " and ")), "backend"
  end
  if backend == "cuda" then
    -- The devices the ranks need (counting them starts nothing and
    -- allocates nothing).
    local count, reason = require("wsync.native.device").count("cuda")
    if not count or count == 0 then
      return M.no_gpu(reason), "backend"
    end
    if recipe.trainer.ranks > count then
      return string.format("%d trainer ranks need %d GPUs, one each; this machine has %d", recipe.trainer.ranks,
        recipe.trainer.ranks, count), "trainer.ranks"
    end
  end
  if runtime.probe then
    local message, field = runtime.probe(recipe)
    if message then
      return message, field
    end
  end
  for index, step in ipairs(recipe.schedule or {}) do
    if step == "generate" and not runtime.generates then
      return string.format("schedule[%d] (generate): the %s runtime does not generate text", index, kind),
        string.format("schedule[%d]", index)
    end
  end
  return nil
end

-- The soft limit called `name` ("Max open files") in /proc/self/limits (luv
-- 1.44 has no getrlimit); nil when it is unlimited or cannot be read.
local function soft_limit(name)
  return tonumber((read_file("/proc/self/limits") or ""):match("\n" .. name .. "%s+(%S+)"))
end

-- True when this process's forks are not held to RLIMIT_NPROC (Linux exempts
-- real uid 0 and CAP_SYS_ADMIN or CAP_SYS_RESOURCE in effect).
local function exempt_from_process_limit()
  local status = read_file("/proc/self/status") or ""
  if status:match("\nUid:%s+(%d+)") == "0" then
    return true
  end
  local effective = tonumber((status:match("\nCapEff:%s+(%x+)") or ""):sub(-8), 16)
  return effective ~= nil and require("bit").band(effective, 2 ^ 21 + 2 ^ 24) ~= 0
end

-- Files this process has open now.
local function open_files()
  local uv = require("luv")
  local scanner = uv.fs_scandir("/proc/self/fd")
  local count = 0
  while scanner and uv.fs_scandir_next(scanner) do
    count = count + 1
  end
  return math.max(count - 1, 0) -- not the directory being read
end

--- Files the host process opens for a run besides one per trainer rank and
--- TP worker: the control endpoint, the runtime's channel, the loop's handles
--- (measured with the demo at 1, 2 and 4 ranks: it runs under `ulimit -n`
--- of the files open before it + 5 + ranks, and fails under one less).
M.FILES_OF_A_RUN = 5

--- Refuses, before the plan is built, a model recipe that this build or
--- this machine cannot run: a runtime kind or backend this build does not
--- serve (M.RUNTIMES); more processes than RLIMIT_NPROC or open files than
--- RLIMIT_NOFILE allow (the schema bounds the ranks by the devices). Reads
--- limits only: allocates and starts nothing.
---@param recipe table  validated, with a model and `path`
function M.check_serve(recipe)
  local message, field = M.unserved(recipe)
  if message then
    refuse(recipe, field, message .. "; `wsync check --plan-only` checks its plan and schedule without running it")
  end
  local control_token, why, token_field = token.control_token(recipe)
  if not control_token and token_field then
    refuse(recipe, token_field, why)
  end
  local path = recipe.control and recipe.control.endpoint
  if path and #path > require("wsync.control.endpoint").MAX_SOCKET_PATH then
    refuse(recipe, "control.endpoint", string.format("%s is %d bytes; a unix socket's path takes at most %d", path,
      #path, require("wsync.control.endpoint").MAX_SOCKET_PATH))
  end

  local world, tp = recipe.trainer.ranks, recipe.runtime.tp
  local synthetic = recipe.trainer.kind == "synthetic" and world or 0
  local processes = synthetic + 1 + tp
  local process_limit = soft_limit("Max processes")
  if process_limit and processes > process_limit and not exempt_from_process_limit() then
    refuse(recipe, "trainer.ranks", string.format("the run starts %d processes (%d synthetic trainer ranks, the "
      .. "runtime's main process, %d TP workers); RLIMIT_NPROC (ulimit -u) allows this user %d", processes,
      synthetic, tp, process_limit))
  end
  local file_limit = soft_limit("Max open files")
  local open = open_files()
  local files = open + M.FILES_OF_A_RUN + math.max(world, tp)
  if file_limit and files > file_limit then
    refuse(recipe, "trainer.ranks", string.format("the host process needs at least %d open files for %d trainer ranks "
      .. "(%d open now, one per rank, %d for the endpoint, the runtime and the loop); RLIMIT_NOFILE (ulimit -n) "
      .. "allows %d", files, world, open, M.FILES_OF_A_RUN, file_limit))
  end
end

-- This machine's memory: physical, or the cgroup's limit when lower.
local function machine_memory()
  local uv = require("luv")
  local total = uv.get_total_memory()
  local constrained = uv.get_constrained_memory and uv.get_constrained_memory() or 0
  if constrained > 0 and constrained < total then
    return constrained, "the cgroup's memory limit"
  end
  return total, "physical memory"
end

--- Refuses a host-backend recipe whose run would hold more than this machine
--- has: the packed buffers (every rank's, in /dev/shm) beyond the free space
--- of /dev/shm, or the buffers, the trainer shards, the TP workers' resident
--- weights and KV arenas beyond its memory. Budgets and reserves
--- (memory.device_bytes, memory.headroom_bytes) are left to the schedule and
--- to the publication's preflight, which asks every device for its free
--- memory. A cuda recipe's device bytes are the devices': check does not
--- query the GPU, the preflight does.
---@param recipe table  validated, with a model and `path`
---@param plan wsync.Plan
---@param topology {world: integer, tp: integer}
---@param report table  wsync.plan.schedule.check's report (its `sizes`)
function M.check_machine(recipe, plan, topology, report)
  if recipe.backend ~= "host" then
    return
  end
  local uv = require("luv")
  local format_bytes = require("wsync.plan").format_bytes
  local sizes, world, tp = report.sizes, topology.world, topology.tp
  local buffers = world * sizes.buffers
  local shm = uv.fs_statfs and uv.fs_statfs("/dev/shm")
  if shm and buffers > shm.bavail * shm.bsize then
    local free = shm.bavail * shm.bsize
    refuse(recipe, "buffers.bytes", string.format("the packed buffers take %d bytes (%s) of /dev/shm (%d trainer "
      .. "ranks x %d buffers x %d bytes); it has %d bytes (%s) free", buffers, format_bytes(buffers), world,
      plan.buffer_count, plan.buffer_bytes, free, format_bytes(free)))
  end
  local parts = {
    { field = "buffers.bytes", what = "packed buffers", bytes = buffers },
    { field = "model", what = "trainer shards", bytes = plan.bytes },
    { field = "model", what = string.format("resident weights of %d TP workers", tp), bytes = tp * sizes.rollout },
    { field = "memory.kv_bytes", what = string.format("KV arenas of %d TP workers", tp), bytes = tp * sizes.kv_cache },
  }
  local total, largest, listed = 0, parts[1], {}
  for _, part in ipairs(parts) do
    total = total + part.bytes
    largest = part.bytes > largest.bytes and part or largest
    listed[#listed + 1] = string.format("%s %d", part.what, part.bytes)
  end
  local memory, what = machine_memory()
  if total > memory then
    refuse(recipe, largest.field, string.format("on the host backend every device is this machine's memory: the run "
      .. "holds %d bytes (%s: %s); the machine has %d bytes (%s, %s)", total, format_bytes(total),
      table.concat(listed, ", "), memory, format_bytes(memory), what))
  end
end

return M
