--- Device memory in use on every GPU of a run, sampled after each step of
--- the memory schedule for the run report: through the driver (NVML,
--- wsync.native.device.gpu_memory), so that the host holds nothing on the
--- devices it watches. A sample lists each device's memory in use (total less
--- free, as cudaMemGetInfo has it: every process's and the driver's own) and
--- the processes on it, named by their role in the run where the pid is one
--- of the run's (a trainer rank, the runtime) and by their command otherwise
--- (vLLM's EngineCore is a child of the runtime). Where the driver's library
--- is missing the probe says why once and samples nothing after.
local device = require("wsync.native.device")
local util = require("wsync.util")

local M = {}

---@class wsync.MemoryProbe
---@field unavailable string?  why nothing is sampled
local Probe = {}
Probe.__index = Probe

--- A probe of the GPUs `uuids` (each once, in order), naming the processes
--- of `roles` (pid -> "trainer rank 0"). `query` stands in for
--- device.gpu_memory (tests).
---@param uuids string[]
---@param roles table<integer, string>
---@param query (fun(uuid: string): table|nil, string?, string?)?
---@return wsync.MemoryProbe
function M.new(uuids, roles, query)
  local seen, devices = {}, {}
  for _, uuid in ipairs(uuids) do
    util.append_unseen(devices, seen, uuid)
  end
  return setmetatable({ devices = devices, roles = roles or {}, query = query or device.gpu_memory }, Probe)
end

--- The probe of a run's devices: every trainer rank's (`ranks`, as
--- wsync.publish.registry's state lists them: {rank, device, pid}) and every
--- TP worker's of `rollout` (wsync.Rollout or ReplicaSet; nil before it
--- starts), the processes named "wsync host", "trainer rank R", "runtime",
--- "TP worker W" (joined where one process is several: an embedded trainer
--- is the host).
---@param ranks {rank: integer, device: string, pid: integer?}[]
---@param rollout table?
---@param query function?  (tests)
---@return wsync.MemoryProbe
function M.of_run(ranks, rollout, query)
  local uuids, roles = {}, {}
  local function add(pid, role)
    if pid then
      roles[pid] = roles[pid] and roles[pid] .. ", " .. role or role
    end
  end
  add(require("luv").os_getpid(), "wsync host")
  for _, rank in ipairs(ranks) do
    uuids[#uuids + 1] = rank.device
    add(rank.pid, "trainer rank " .. rank.rank)
  end
  if rollout then
    add(rollout:state().pid, "runtime")
    for index, worker in ipairs(rollout:workers()) do
      uuids[#uuids + 1] = worker.device and worker.device.uuid
      add(worker.pid, "TP worker " .. (index - 1))
    end
  end
  return M.new(uuids, roles, query)
end

--- What process `pid` is: its role in the run, else "pid N (COMMAND)" from
--- /proc (a process of this machine's pid namespace), else "pid N".
---@param pid integer
---@return string
function Probe:role_of(pid)
  local role = self.roles[pid]
  if role then
    return role
  end
  local file = io.open(string.format("/proc/%d/comm", pid), "r")
  local command = file and file:read("*l")
  if file then
    file:close()
  end
  return command and string.format("pid %d (%s)", pid, command) or string.format("pid %d", pid)
end

--- Samples every device now: {{device = uuid, used_bytes, total_bytes,
--- processes = {{pid, role, used_bytes?}}?}}, or nil once the driver's
--- library could not be used (`unavailable` says why).
---@return table[]?
function Probe:sample()
  if self.unavailable then
    return nil
  end
  local sample = {}
  for index, uuid in ipairs(self.devices) do
    local memory, message = self.query(uuid)
    if not memory then
      self.unavailable = message
      return nil
    end
    local entry = { device = uuid, used_bytes = memory.used_bytes, total_bytes = memory.total_bytes }
    if memory.processes then
      entry.processes = {}
      for i, process in ipairs(memory.processes) do
        entry.processes[i] = { pid = process.pid, role = self:role_of(process.pid), used_bytes = process.used_bytes }
      end
    end
    sample[index] = entry
  end
  return sample
end

local GIB = 1024 ^ 3

--- One device's entry of a sample as text: "12.34 GiB (trainer rank 0
--- 3.20, pid 812 (VLLM::EngineCor) 8.10)".
---@param entry table
---@return string
function M.describe(entry)
  local parts = {}
  for _, process in ipairs(entry.processes or {}) do
    parts[#parts + 1] = process.used_bytes and string.format("%s %.2f", process.role, process.used_bytes / GIB)
      or process.role
  end
  return string.format("%.2f GiB%s", entry.used_bytes / GIB, #parts > 0 and " (" .. table.concat(parts, ", ") .. ")"
    or "")
end

return M
