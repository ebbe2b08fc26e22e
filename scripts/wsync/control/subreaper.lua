--- This process as a child subreaper (PR_SET_CHILD_SUBREAPER), for as long as
--- it holds process trees whose orphans must come back to it. A rollout
--- runtime spawned in a session of its own (wsync.control.client) holds it
--- from its spawn until its whole group is gone: its TP workers, orphaned
--- when its main process dies first, are then reparented here, not to an
--- init that may never reap them (a container's), so that the client reaps
--- them and counts the tree as gone only once they are.
---
--- A subreaper adopts every orphan below it, not only a runtime's: whoever
--- becomes one owns reaping them all. The `wsync` command line starts its
--- children only through the loop (`claim_children`): there every exited
--- child that no process handle of the loop waits for was adopted, and is
--- reaped as soon as SIGCHLD says it ended. When the last hold is released
--- the process stops being a subreaper, and it reaps the orphans it adopted
--- meanwhile until none is left. An embedding program has children of its
--- own that it waits for itself: there only the runtime's group is reaped (by
--- the client), and the process is a subreaper only while a runtime lives.
---
--- (A Lua script that `wsync FILE.lua` runs and that waits for a child itself,
--- io.popen's, does so before the loop runs again.)
local uv = require("luv")
local loop = require("wsync.loop")
local process = require("wsync._process")

local M = {}

local holds = 0 -- trees that hold the subreaper now
local claimed = false -- every child of this process is the loop's (claim_children)
local watcher = nil -- SIGCHLD, while adopted children may end (claimed only)

---@class wsync.SubreaperHold
---@field held boolean  false once released
local Hold = {}
Hold.__index = Hold

--- The pids of the children that a process handle of the loop waits for
--- (libuv reaps those itself, and reports their exit).
---@return table<integer, boolean>
local function loop_children()
  local pids = {}
  uv.walk(function(handle)
    if handle:get_type() == "process" and handle:is_active() then
      pids[handle:get_pid()] = true
    end
  end)
  return pids
end

--- Reaps the children of this process that exited and that no process
--- handle of the loop waits for: with `claim_children`, every one it adopted.
--- Returns how many it reaped and how many such children still run, or nil
--- and a message when /proc cannot be read.
---@return integer|nil reaped, integer|string living_or_message
function M.reap_adopted()
  local children, message = process.children()
  if not children then
    return nil, message
  end
  local waited = loop_children()
  local reaped, living = 0, 0
  for _, child in ipairs(children) do
    if not waited[child.pid] then
      if not child.exited then
        living = living + 1
      elseif process.reap(child.pid) then
        reaped = reaped + 1
      end
    end
  end
  return reaped, living
end

-- SIGCHLD: a child ended (an adopted one too). Reaps; stops watching once no
-- hold is left and no adopted child runs.
local function on_child()
  local reaped, living = M.reap_adopted()
  if reaped and holds == 0 and living == 0 then
    watcher:stop()
  end
end

local function watch()
  if watcher == nil or watcher:is_closing() then
    watcher = uv.new_signal()
    loop.keep(watcher) -- (the host's own, closed by close_all)
  end
  if not watcher:is_active() then
    watcher:start("sigchld", on_child)
    watcher:unref() -- (the loop ends when its work does, not when children do)
  end
end

--- Declares that this process starts its children only through the loop, as
--- the `wsync` command line does: the children it adopts as a subreaper are
--- then reaped as they end (an embedding program's are not taken from it).
function M.claim_children()
  claimed = true
end

--- Makes this process a subreaper until the hold is released (holds count:
--- the process stays one while any is held). Take it before spawning the
--- tree, so that no orphan of it can go elsewhere.
---@return wsync.SubreaperHold
function M.hold()
  if holds == 0 then
    -- (Fails only on a kernel older than Linux 3.4: the orphans then go to
    -- init, as they would without it.)
    process.set_subreaper(true)
  end
  holds = holds + 1
  if claimed then
    watch()
  end
  return setmetatable({ held = true }, Hold)
end

--- Releases the hold (again: nothing). With the last one the process stops
--- being a subreaper; the orphans it adopted are reaped as they end.
function Hold:release()
  if not self.held then
    return
  end
  self.held = false
  holds = holds - 1
  if holds == 0 then
    process.set_subreaper(false)
    if watcher and watcher:is_active() then
      on_child()
    end
  end
end

return M
