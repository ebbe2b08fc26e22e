---@meta wsync._process
-- LuaCATS stubs for `wsync._process` (bindings/l_process.c): process-group
-- signals, reaping and /proc checks. Not loaded at run time; read by the Lua
-- language server. tests/bindings/meta_spec.lua checks the stubs.

---@alias wsync.SignalName "SIGTERM"|"SIGKILL"|"SIGINT"|"SIGHUP"|"SIGSTOP"|"SIGCONT"

---@class wsync._process
local process = {}

--- Makes this process the reaper of its orphaned descendants (true), or no
--- longer (false: those it adopted stay its children).
---@param enabled boolean
---@return true|nil ok, string? message, string? code
function process.set_subreaper(enabled) end

--- Asks the kernel to send `signal` when the parent dies; fails at once when
--- the parent is no longer `expected_parent` (it died already).
---@param signal wsync.SignalName
---@param expected_parent integer?
---@return true|nil ok, string? message, string? code
function process.die_with_parent(signal, expected_parent) end

---@param group integer  a process group id above 1
---@param signal wsync.SignalName
---@return true|nil ok, string? message, string? code
function process.signal_group(group, signal) end

--- Reaps the group's exited children without waiting.
---@param group integer
---@return integer|nil reaped, string? message, string? code
function process.reap_group(group) end

--- Counts the live processes of the group (from /proc).
---@param group integer
---@return integer|nil count, string? message, string? code
function process.count_group(group) end

--- This process's children (from /proc); `exited`: it waits to be reaped.
---@return {pid: integer, exited: boolean}[]|nil children, string? message, string? code
function process.children() end

--- Reaps child `pid` if it exited, without waiting: true then, false while it
--- runs. Code "ENOTFOUND": no child of this process.
---@param pid integer
---@return boolean|nil reaped, string? message, string? code
function process.reap(pid) end

--- A descriptor (pidfd) that becomes readable when process `pid` exits;
--- close it with uv.fs_close. Code "ENOTFOUND": no such process; "ENODEV":
--- no pidfd_open on this system.
---@param pid integer
---@return integer|nil fd, string? message, string? code
function process.watch(pid) end

--- The pids of the processes other than this one whose initial environment
--- holds `entry` ("NAME=VALUE") exactly, or that belong to one of `sessions`
--- (at most 64 session ids).
---@param entry string
---@param sessions integer[]?
---@return integer[]|nil pids, string? message, string? code
function process.find_marked(entry, sessions) end

return process
