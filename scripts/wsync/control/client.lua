--- The host's end of a spawned process it drives over the control protocol:
--- the rollout runtime (in its own process group) or, inside the reference
--- runtime, one TP worker.
---
--- One request in flight. States: IDLE -> INFLIGHT -> IDLE on a valid answer;
--- INFLIGHT -> BROKEN on a timeout, EOF, process exit, a bad frame, a wrong
--- protocol/id/cmd/result type, or a failed command that must not fail (sleep,
--- wake, weight transfer, or any answer marked fatal). BROKEN is terminal: the
--- process tree gets SIGTERM, SIGKILL after the grace period, and is reaped;
--- every later call fails at once with the original cause.
local uv = require("luv")
local channel_module = require("wsync.control.channel")
local errors = require("wsync.errors")
local guard = require("wsync.control.guard")
local inflight_module = require("wsync.control.inflight")
local loop = require("wsync.loop")
local messages = require("wsync.control.messages")
local process = require("wsync._process")
local subreaper = require("wsync.control.subreaper")
local timeouts_module = require("wsync.control.timeouts")
local util = require("wsync.util")

local M = {}

--- Per-command timeouts in seconds (wsync.control.timeouts); a recipe's
--- `timeouts` table overrides them.
M.DEFAULT_TIMEOUTS = timeouts_module.DEFAULTS

--- Commands whose failure breaks the connection even when answered cleanly:
--- after a failed sleep, wake or weight command the runtime's memory state is
--- unknown.
M.FATAL_COMMANDS = {
  sleep = true, wake = true, init_weights = true, start_update = true, load_chunk = true,
  finish_update = true, release = true, shutdown = true,
}

--- The timeouts for the next hop down: a process that forwards a command
--- (the runtime's main process to its TP workers) waits for its own peers a
--- little less than it is given itself, so that the hop that stopped
--- answering is the one named when a command times out: 80% of each timeout,
--- or one second less when that is shorter.
---@param timeouts table<string, number>
---@return table<string, number>
function M.inner_timeouts(timeouts)
  local inner = {}
  for key, value in pairs(timeouts) do
    inner[key] = math.max(value - 1, value * 0.8)
  end
  return inner
end

--- How long the host polls without sleeping after sending a request: quick
--- answers (info, state) then arrive without an idle-CPU wake-up. Only on a
--- machine with cores to spare (wsync.loop.SPARE_CORES); $WSYNC_CLIENT_SPIN_US
--- overrides.
M.SPIN_MICROSECONDS = tonumber(os.getenv("WSYNC_CLIENT_SPIN_US") or "") or (loop.SPARE_CORES and 300 or 0)

---@class wsync.RuntimeClient
---@field name string
---@field state "IDLE"|"INFLIGHT"|"BROKEN"|"CLOSED"
---@field pid integer
---@field group integer?   process group of the tree (own group when detached)
---@field subreaper_hold wsync.SubreaperHold? held from the spawn of a detached tree until it is gone
---@field cause wsync.Error? why it broke
---@field startup_info table? the answer to the startup `info`
local Client = {}
Client.__index = Client
M.Client = Client -- its methods, for tests

local describe_exit

local function seconds(value)
  return string.format("%.3g s", value)
end

---@class wsync.RuntimeClientOptions
---@field argv string[]
---@field name string?
---@field name_pid boolean?
---@field detached boolean?
---@field timeouts table?
---@field grace_ms integer?
---@field env string[]?
---@field limit integer?
---@field handshake string?
---@field results table?
---@field output string?  a prefix: the process's stdout and stderr come through this one, each line with it
---@field on_slow fun(client: wsync.RuntimeClient, cmd: string, seconds: number, deadline: number)?

--- Spawns `options.argv` (program first) with a private control channel on its
--- fd 3 and performs the startup handshake (`info`). Must run inside a
--- coroutine started by wsync.loop.spawn. Raises RUNTIME_START when the process
--- cannot start or the handshake fails (the process tree is destroyed first).
--- `name_pid` adds the process's pid to its name in every message ("TP
--- worker 1 (pid 4242)"); `results` gives the shapes of the results, by
--- command (wsync.control.messages): a result that does not fit breaks the client.
--- `on_slow` is called while a command waits for its answer, after 5 s and
--- then each time the wait doubled (the handshake included), so that the
--- host can say what it waits for; it must not raise.
---@param options wsync.RuntimeClientOptions
---@return wsync.RuntimeClient
function M.spawn(options)
  local timeouts = timeouts_module.with(options.timeouts)
  local self = setmetatable({
    name = options.name or "runtime",
    state = "IDLE",
    timeouts = timeouts,
    grace_ms = options.grace_ms or 3000,
    death = loop.condition(),
    dead = false,
    result_schemas = options.results or {},
  }, Client)

  local detached = options.detached ~= false
  if detached then
    -- Orphans of the runtime (its workers, once its main process is gone) come
    -- back to the host so that they can be reaped, not left to init, until
    -- the tree is gone (_mark_dead).
    self.subreaper_hold = subreaper.hold()
  end

  -- The child gets this process's environment with options.env's entries
  -- replacing variables of the same name, and WSYNC_PARENT_PID: the pid it
  -- must find as its parent when it asks to die with it. A tree of its own
  -- also gets the guard's mark (wsync.control.guard): should this host die,
  -- the guard ends it, grandchildren included.
  local entries = { unpack(options.env or {}) }
  entries[#entries + 1] = "WSYNC_PARENT_PID=" .. tostring(uv.os_getpid())
  if detached then
    entries[#entries + 1] = guard.environment()
  end
  local env = util.environment(entries)
  local control = uv.new_pipe(false)
  local argv = options.argv
  -- (Its lines, prefixed, where this process relays its children's output;
  -- fd 3 stays the control channel either way.)
  local relay = options.output and require("wsync.output").new(options.output)
  local handle, pid_or_error = uv.spawn(argv[1], {
    args = { unpack(argv, 2) },
    stdio = { nil, relay and relay.stdout or 1, relay and relay.stderr or 2, control },
    env = env,
    detached = detached,
  }, function(code, signal)
    self:_on_exit(code, signal)
  end)
  if relay then
    relay:spawned(handle ~= nil)
  end
  if not handle then
    control:close()
    if self.subreaper_hold then
      self.subreaper_hold:release()
    end
    errors.raise("RUNTIME_START", string.format("cannot start %s (%s): %s", self.name, argv[1],
      tostring(pid_or_error)))
  end
  self.handle, self.pid = handle, pid_or_error
  self.group = detached and self.pid or nil
  if detached then
    guard.watch(self.pid) -- (its own session: the guard ends it whole)
  end
  if options.name_pid then
    self.name = string.format("%s (pid %d)", self.name, self.pid)
  end

  self.channel = channel_module.new(control, {
    limit = options.limit,
    on_message = function(message)
      self:_on_message(message)
    end,
    on_close = function(reason)
      if reason == "EOF" then
        reason = "the control channel closed (EOF)"
        if self.exit_status then
          reason = reason .. string.format("; process %d exited (%s)", self.pid, describe_exit(self.exit_status))
        end
      end
      self:_break(reason)
    end,
  })
  self.inflight = inflight_module.new(self.channel)
  if options.on_slow then
    self.inflight:watch(function(pending, waited)
      options.on_slow(self, pending.cmd, waited, pending.seconds)
    end)
  end

  local handshake = options.handshake or "info"
  local ok, result = self:_call(handshake, {}, timeouts.startup)
  if not ok then
    -- A handshake answered with a clean failure leaves the process running:
    -- break it too, so that the tree is destroyed before this raises. A
    -- process that did not start holds nothing to clean up: no grace period
    -- (one stopped by SIGSTOP would only wait it out).
    self:_break(result.message)
    self:_signal("SIGKILL")
    self:wait_dead()
    errors.raise("RUNTIME_START", string.format("%s did not start: %s", self.name, result.message),
      { cause = result, pid = self.pid, group = self.group })
  end
  self.startup_info = result
  return self
end

function describe_exit(status)
  if status.signal ~= 0 then
    return "signal " .. status.signal
  end
  return "code " .. status.code
end

function Client:_on_exit(code, signal)
  self.exit_status = { code = code, signal = signal }
  if not self.handle:is_closing() then
    self.handle:close()
  end
  if self.state == "IDLE" or self.state == "INFLIGHT" then
    local reason = string.format("process %d exited (%s)", self.pid, describe_exit(self.exit_status))
    if self.channel.closed then
      self:_break(reason)
    else
      -- An answer written just before the exit may still be in the channel:
      -- let its EOF end the connection, or break if it stays open.
      self.exit_timer = loop.after(1000, function()
        self.exit_timer = nil
        self:_break(reason)
      end)
    end
  end
  self:_collect_tree()
end

function Client:_on_message(message)
  local pending, reason = self.inflight:take(message)
  if not pending then
    return self:_break(reason)
  end
  self.state = "IDLE"
  if message.ok then
    local result, bad = messages.check(self.result_schemas, pending.cmd, message.result)
    if bad then
      return self:_break("malformed result: " .. bad, pending)
    end
    return pending.resume(true, result)
  end
  local remote = message.error
  local detail = string.format("%s failed: %s: %s", pending.cmd, remote.code, remote.message)
  if remote.fatal or M.FATAL_COMMANDS[pending.cmd] then
    return self:_break(detail, pending, remote.rank) -- resumes the caller with the cause
  end
  pending.resume(false, errors.new("RUNTIME_COMMAND_FAILED", string.format("%s: %s", self.name, detail), {
    phase = pending.cmd,
    rank = remote.rank,
    remote_code = remote.code,
    remote_traceback = remote.traceback,
  }))
end

-- Sends one request and waits. Returns true, result or false, error object.
function Client:_call(cmd, payload, timeout)
  if self.cause then -- broken, or closed after breaking: the original cause
    return false, self.cause
  elseif self.state == "CLOSED" then
    return false, errors.new("RUNTIME_CLOSED", self.name .. " is closed", { phase = cmd })
  elseif self.state == "INFLIGHT" then
    error(string.format("%s: %s requested while %s is in flight (one request at a time)", self.name, cmd,
      self.inflight.pending.cmd), 3)
  end
  local pending, reason = self.inflight:send(cmd, payload, timeout, function(timed_out)
    self:_break(string.format("timeout: no answer to %s within %s", cmd, seconds(timeout)), timed_out)
  end)
  if not pending then
    self:_break("cannot send " .. cmd .. ": " .. reason)
    return false, self.cause
  end
  self.state = "INFLIGHT"
  if M.SPIN_MICROSECONDS > 0 then
    loop.spin(M.SPIN_MICROSECONDS)
  end
  return self.inflight:await(pending)
end

--- Sends `cmd` with `payload` and returns the result table. Raises the break
--- cause (code RUNTIME_BROKEN) when the runtime is or becomes broken, and
--- RUNTIME_COMMAND_FAILED when a non-fatal command fails (the runtime stays
--- usable). Must run inside a coroutine started by wsync.loop.spawn.
---@param cmd string
---@param payload table?
---@return table
function Client:request(cmd, payload)
  local ok, result = self:_call(cmd, payload or {}, timeouts_module.of_command(self.timeouts, cmd))
  if not ok then
    error(result, 2)
  end
  return result
end

--- `info`: the runtime's protocol, TP world, workers' device identities,
--- capabilities and memory state.
function Client:info()
  return self:request("info")
end

--- Marks the connection BROKEN with `reason` and destroys the process tree
--- (SIGTERM, SIGKILL after the grace period; `wait_dead` waits for it): for
--- a runtime whose state is no longer known. A request in flight fails with
--- the cause; every later call too.
---@param reason string
function Client:destroy(reason)
  self:_break(reason)
end

-- Marks the connection BROKEN with `reason` and destroys the process tree.
-- Only the first cause counts. `rank`: the TP worker the runtime named.
function Client:_break(reason, pending, rank)
  if self.state == "BROKEN" or self.state == "CLOSED" then
    return
  end
  pending = pending or self.inflight.pending
  local during = pending and (" during " .. pending.cmd) or ""
  self.cause = errors.new("RUNTIME_BROKEN", string.format("%s broken%s: %s", self.name, during, reason), {
    phase = pending and pending.cmd or nil,
    rank = rank,
  })
  self.state = "BROKEN"
  loop.cancel(self.exit_timer)
  self.exit_timer = nil
  self.inflight:close()
  self.channel:close()
  self:_destroy_tree()
  if pending and pending.resume then
    pending.resume(false, self.cause)
  end
end

-- SIGTERM to the tree now, SIGKILL after the grace period unless it is gone.
-- A tree already gone (its death was seen before the break) needs neither.
function Client:_destroy_tree()
  if self.destroying or self.dead then
    return
  end
  self.destroying = true
  self:_signal("SIGTERM")
  self.kill_timer = loop.after(self.grace_ms, function()
    self.kill_timer = nil
    if not self.dead then
      self:_signal("SIGKILL")
    end
  end)
end

function Client:_signal(name)
  if self.group then
    process.signal_group(self.group, name)
  elseif not self.exit_status then
    uv.process_kill(self.handle, name:lower())
  end
end

--- Whether no process of group `group` is left: kill(-group, 0) fails with
--- ESRCH. Any other answer (a member, or EPERM) counts as not empty, so that
--- a tree whose state cannot be read keeps being escalated, not forgotten.
---@param group integer
---@return boolean
function M.group_empty(group)
  local _, _, code = uv.kill(-group, 0)
  return code == "ESRCH"
end

-- After the main process exited: reap its group's orphans until no member of
-- the group is left, then wake whoever waits for the death. Past the grace
-- period the group gets SIGKILL at every check.
function Client:_collect_tree()
  if not self.group then
    return self:_mark_dead()
  end
  local poll = uv.new_timer()
  local started = uv.now()
  local function check()
    process.reap_group(self.group)
    if M.group_empty(self.group) then
      poll:close()
      return self:_mark_dead()
    end
    if uv.now() - started > self.grace_ms then
      process.signal_group(self.group, "SIGKILL")
    end
    poll:start(5, 0, check)
  end
  check()
end

function Client:_mark_dead()
  self.dead = true
  if self.group then
    guard.unwatch(self.group)
  end
  if self.subreaper_hold then
    self.subreaper_hold:release()
  end
  loop.cancel(self.kill_timer)
  self.kill_timer = nil
  self.death:notify()
end

--- Waits until the process and its whole group are gone and reaped.
function Client:wait_dead()
  self.death:wait(function()
    return self.dead
  end)
end

--- Shuts a healthy runtime down politely (`shutdown`, then the same
--- escalation if it does not exit within the grace period) and waits until the
--- tree is gone. A broken runtime is only waited for. Returns true, or nil and
--- the error that broke it. `options.wait = false`: a runtime that broke
--- (also during the shutdown) is not waited for; its tree is destroyed all
--- the same, and `wait_dead` waits for that later.
---@param options {wait: boolean?}?
---@return boolean|nil ok, wsync.Error? cause
function Client:close(options)
  local wait = not (options and options.wait == false)
  if self.state == "CLOSED" then
    if self.cause then -- closed after breaking: still the original cause
      return nil, self.cause
    end
    return true
  end
  if self.state == "INFLIGHT" then
    error(string.format("%s: close() while %s is in flight", self.name, self.inflight.pending.cmd), 2)
  end
  if self.state == "IDLE" then
    local ok = self:_call("shutdown", {}, self.timeouts.shutdown)
    if ok then
      -- Answered: from here on an exit or EOF is expected, not a failure.
      self.state = "CLOSED"
      self.channel:close()
      if not self.dead then
        -- Give it the grace period to exit by itself, then destroy the tree.
        local timer = loop.after(self.grace_ms, function()
          if not self.dead then
            self:_destroy_tree()
          end
        end)
        self:wait_dead()
        loop.cancel(timer)
      end
    end
  end
  if wait or not self.cause then
    self:wait_dead()
  end
  local cause = self.cause
  self.inflight:close()
  self.channel:close()
  self.state = "CLOSED"
  if cause then
    return nil, cause
  end
  return true
end

--- A one-line summary for the REPL and reports.
function Client:__tostring()
  local text = string.format("%s pid %d: %s", self.name, self.pid or -1, self.state)
  if self.cause then
    text = text .. " (" .. self.cause.message .. ")"
  end
  return text
end

return M
