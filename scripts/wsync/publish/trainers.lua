--- A session's synthetic trainer processes (`wsync trainer`, one per rank;
--- a recipe's trainer.kind = "synthetic"): spawned in process groups of
--- their own, each one's exit recorded as it comes, and at the session's end
--- given a moment to exit by themselves before SIGKILL; on an abort (a
--- signal) killed at once. It says how each ended, and which one failed the
--- run. It knows processes, not the ranks' connections to the host. External
--- trainer ranks have no process here: a session of them has an empty one.
local uv = require("luv")
local console = require("wsync.publish.console")
local errors = require("wsync.errors")
local output = require("wsync.output")
local util = require("wsync.util")

local M = {}

local say = console.say

--- How long an abort waits for its killed trainers to be gone, in ms.
M.ABORT_WAIT_MS = 2000

--- How long the session's end gives a rank to exit by itself before
--- SIGKILL, and how long it then waits for the killed ones, in seconds.
M.EXIT_GRACE = 2
M.KILL_WAIT = 10

--- "signal 9" or "code 1".
---@param code integer
---@param signal integer
---@return string
function M.describe_exit(code, signal)
  return signal ~= 0 and ("signal " .. signal) or ("code " .. code)
end

---@class wsync.Trainers
local Trainers = {}
Trainers.__index = Trainers

--- No processes yet, for `session` (wsync.publish.session): its condition
--- is notified whenever one exits, and the waits here are on it; its
--- `phase` and `stopped` decide whether an exit is said at once.
---@param session {condition: wsync.Condition, phase: string, stopped: wsync.Error?}
---@return wsync.Trainers
function M.new(session)
  return setmetatable({ session = session, condition = session.condition, world = 0, handles = {}, started_pids = {},
    exits = {}, killed = {} }, Trainers)
end

--- How the synthetic trainer rank `rank` of `recipe` starts, connecting to
--- `endpoint` (a path): the wsync program's `trainer` command, in the care
--- of the guard (wsync.control.guard) by the mark in its environment. For
--- Trainers:spawn.
---@param recipe table
---@param endpoint string
---@param world integer
---@return fun(rank: integer): {program: string, args: string[], env: string[]?}
function M.synthetic(recipe, endpoint, world)
  local program = util.program()
  local model = recipe.model.preset or require("cjson").encode(recipe.model.config)
  return function(rank)
    return {
      program = program,
      args = {
        "trainer", "--endpoint", endpoint, "--rank", tostring(rank), "--world", tostring(world), "--model", model,
        "--versions", tostring(recipe.trainer.steps), "--backend", recipe.backend,
        "--storage", recipe.trainer.storage or "one",
      },
      -- (Should this host die, the guard ends them too.)
      env = util.environment({ require("wsync.control.guard").environment() }),
    }
  end
end

--- Starts one process for each rank of 0 .. world - 1, as `launch(rank)`
--- says ({program, args, env}), in rank order; its output relayed with the
--- prefix "[trainer RANK] " (wsync.output). Raises TRAINER_START naming the
--- rank that did not start (those before it run on: close them).
---@param world integer
---@param launch fun(rank: integer): {program: string, args: string[], env: string[]?}
function Trainers:spawn(world, launch)
  self.world = world
  for rank = 0, world - 1 do
    local command = launch(rank)
    -- (Its lines prefixed, where this process relays its children's output.)
    local relay = output.new(string.format("[trainer %d] ", rank))
    local handle, pid
    handle, pid = uv.spawn(command.program, {
      args = command.args,
      stdio = { nil, relay and relay.stdout or 1, relay and relay.stderr or 2 },
      -- A process group (and session) of its own: the terminal's Ctrl-C is
      -- the host's to handle (the REPL interrupts a chunk, `wsync run` stops
      -- in order), not a signal that kills the ranks under a session.
      detached = true,
      env = command.env,
    }, function(code, signal)
      self.exits[rank] = { code = code, signal = signal }
      handle:close()
      -- Said at once (the session fails when its connection ends too): a
      -- rank killed by a signal the host did not send, or one that ended
      -- before the session did.
      local session = self.session
      local ending = session.phase == "closing" or session.phase == "closed"
      if not ending and not self.killed[rank] and (signal ~= 0 or (code ~= 0 and session.stopped == nil)) then
        say("synthetic trainer rank %d (pid %d) exited (%s) during %s", rank, pid, M.describe_exit(code, signal),
          session.phase)
      end
      self.condition:notify()
    end)
    if relay then
      relay:spawned(handle ~= nil)
    end
    if not handle then
      errors.raise("TRAINER_START", string.format("cannot start synthetic trainer rank %d: %s", rank, tostring(pid)))
    end
    self.handles[rank] = handle
    self.started_pids[pid] = true
  end
end

--- Whether rank `rank` has a process here (a synthetic rank that started).
---@param rank integer
---@return boolean
function Trainers:spawned(rank)
  return self.handles[rank] ~= nil
end

--- How rank `rank`'s process exited ({code, signal}), nil while it runs (or
--- when it has none).
---@param rank integer
---@return {code: integer, signal: integer}?
function Trainers:exit_of(rank)
  return self.exits[rank]
end

--- How rank `rank`'s process exited, as M.describe_exit says it; nil
--- while it runs (or when it has none).
---@param rank integer
---@return string?
function Trainers:describe(rank)
  local exit = self.exits[rank]
  return exit and M.describe_exit(exit.code, exit.signal)
end

--- Whether any process exited.
---@return boolean
function Trainers:any_exited()
  return next(self.exits) ~= nil
end

--- Every process's pid ever started, as a set ({[pid] = true}).
---@return table<integer, boolean>
function Trainers:pids()
  return self.started_pids
end

-- True once every process that `spared(rank)` does not name has exited.
function Trainers:_all_exited(spared)
  for rank in pairs(self.handles) do
    if not self.exits[rank] and not (spared and spared(rank)) then
      return false
    end
  end
  return true
end

--- Ends the processes at the session's end: unless `patient` is false, up
--- to M.EXIT_GRACE s for them to exit by themselves (a rank that
--- `spared(rank)` names gets no moment: it may be stopped, or hung); then
--- SIGKILL to each still running, said, and up to M.KILL_WAIT s for them
--- to end. Returns the seconds it took, nil when it has no processes.
---@param patient boolean
---@param spared fun(rank: integer): boolean
---@return number?
function Trainers:stop(patient, spared)
  local started = uv.hrtime() / 1e9
  if patient then
    self.condition:wait_for(M.EXIT_GRACE, function()
      return self:_all_exited(spared)
    end)
  end
  for rank, handle in pairs(self.handles) do
    if not self.exits[rank] and not handle:is_closing() then
      say("trainer rank %d (pid %s) did not exit: killed", rank, tostring(handle:get_pid()))
      self.killed[rank] = true
      handle:kill("sigkill")
    end
  end
  if not self.condition:wait_for(M.KILL_WAIT, function()
    return self:_all_exited()
  end) then
    say("synthetic trainer processes did not end %d s after SIGKILL", M.KILL_WAIT)
  end
  return next(self.handles) and uv.hrtime() / 1e9 - started or nil
end

-- Waits, without running the loop (the process exits right after), until
-- every process of `pids` ({[pid] = true}) has ended: gone from /proc, or a
-- zombie that its parent did not reap yet. At most `ms` milliseconds.
local function wait_gone(pids, ms)
  local deadline = uv.hrtime() + ms * 1e6
  for pid in pairs(pids) do
    while uv.hrtime() < deadline do
      local stat = util.read_file("/proc/" .. pid .. "/stat") or ""
      if stat == "" or stat:match("%) Z ") or stat:match("%) X ") then
        break
      end
      uv.sleep(1)
    end
  end
end

--- Kills every process still running with SIGKILL and waits, without
--- running the loop, up to M.ABORT_WAIT_MS for them to be gone or zombies:
--- for an abort, after which the process exits.
function Trainers:kill_now()
  for _, handle in pairs(self.handles) do
    if not handle:is_closing() then
      handle:kill("sigkill")
    end
  end
  wait_gone(self.started_pids, M.ABORT_WAIT_MS)
end

--- How each rank's process ended, for the closing report: "rank 0 exited
--- with code 0, rank 1 killed"; nil when there are none.
---@return string?
function Trainers:ends()
  if not next(self.handles) then
    return nil
  end
  local ends = {}
  for rank = 0, self.world - 1 do
    local status = self.exits[rank]
    ends[#ends + 1] = string.format("rank %d %s", rank, not status and "still running" or self.killed[rank]
      and "killed" or status.signal ~= 0 and ("ended by signal " .. status.signal)
      or ("exited with code " .. status.code))
  end
  return table.concat(ends, ", ")
end

--- The run's failure for the lowest rank whose process exited with a code
--- other than 0 (TRAINER_FAILED; killed at the end: it did not exit within
--- `shutdown` s, timeouts.shutdown); nil when none did.
---@param shutdown number
---@return wsync.Error?
function Trainers:failure(shutdown)
  for rank = 0, self.world - 1 do
    local status = self.exits[rank]
    if status and status.code ~= 0 then
      return errors.new("TRAINER_FAILED", string.format("synthetic trainer rank %d %s", rank, self.killed[rank]
        and string.format("did not exit within %g s of the session's end (timeouts.shutdown) and was killed",
          shutdown) or ("exited with " .. M.describe_exit(status.code, status.signal))), { rank = rank })
    end
  end
  return nil
end

return M
