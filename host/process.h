// Process-tree control for spawned runtimes: signals to a whole process
// group, reaping of orphans reparented to the host, and checks read from /proc.
#pragma once

#include "status_defs.h"

#ifndef WS_FFI
#include <sys/types.h>
#endif

/// Makes this process a child subreaper (PR_SET_CHILD_SUBREAPER) when
/// `enabled` is nonzero: orphans of the processes it spawns are reparented to
/// it, so it can reap them. With 0 it stops being one; the orphans it already
/// adopted stay its children.
int ws_process_set_subreaper(int enabled);

/// Asks the kernel to send `signal_number` to this process when its parent
/// dies (PR_SET_PDEATHSIG); fails with WS_ESTATE when the parent is already
/// gone: when the parent is no longer `expected_parent` (the pid the spawner
/// passed down), or, with `expected_parent` 0, when it changed during the call.
int ws_process_die_with_parent(int signal_number, int expected_parent);

/// Sends `signal_number` to every process of group `group`. A group with no
/// process left is not an error.
int ws_process_signal_group(int group, int signal_number);

/// Reaps, without blocking, every exited child of this process that belongs
/// to group `group`; stores how many in `*reaped`.
int ws_process_reap_group(int group, int *reaped);

/// Counts the processes of group `group` that still exist (zombies included)
/// by reading /proc, and stores the count in `*count`.
int ws_process_count_group(int group, int *count);

/// Lists this process's children, read from /proc: up to `capacity` pids in
/// `pids` and, when `exited` is not NULL, 1 there for a child that exited and
/// waits to be reaped (a zombie), 0 for one that runs. Stores how many
/// children there are in `*count` (which may exceed `capacity`).
int ws_process_children(int *pids, int *exited, int capacity, int *count);

/// Reaps child `pid` if it exited, without waiting: `*reaped` is 1 then, 0
/// while it runs. WS_ENOTFOUND: `pid` is no child of this process (any more).
int ws_process_reap(int pid, int *reaped);

/// Opens a descriptor that becomes readable when process `pid` exits (a
/// pidfd, close-on-exec): a watch on that one process that a reused pid
/// cannot fool. Stores it in `*fd`; the caller closes it. WS_ENOTFOUND: no
/// such process; WS_ENODEV: the kernel (or what runs the process, valgrind)
/// has no pidfd_open.
int ws_process_watch(int pid, int *fd);

/// Finds the processes other than this one whose environment, as it was when
/// they started (/proc/PID/environ), holds the entry `entry` ("NAME=VALUE")
/// exactly, or that belong to one of the `session_count` sessions `sessions`:
/// how a process tree is found whatever process group or session its members
/// moved to (the mark), also when a member wrote over its environment's
/// memory, as setproctitle does (the session). Stores up to `capacity` pids
/// in `pids` and how many were found in `*count` (which may exceed
/// `capacity`). Zombies and processes whose environment and stat cannot be
/// read (another user's) are not found.
int ws_process_find_marked(const char *entry, const int *sessions,
                           int session_count, int *pids, int capacity,
                           int *count);
