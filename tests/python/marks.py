"""The processes that carry a mark in their environment (``NAME=VALUE``), found through
/proc: how the tests see every process a run started, short-lived children included
(conftest's sessions, tests/gpu/vllm_faults.py); and the processes of given sessions, for
those whose environment's memory was written over (vLLM's EngineCore sets its title with
setproctitle, which does that). No pytest here: GPU scripts import it."""
from __future__ import annotations

import os


def marked_pids(entry: bytes) -> set[int]:
    """The pids, other than this process's, whose environment holds ``entry``."""
    found = set()
    own = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == own:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as environ:
                if entry in environ.read().split(b"\0"):
                    found.add(int(name))
        except OSError:
            continue
    return found


def _stat(pid: str) -> list[str]:
    """The fields of /proc/PID/stat after the command name: state, ppid, pgrp, session, ..."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()


def in_sessions(sessions: set[int]) -> set[int]:
    """The pids, other than this process's, of the live processes (no zombies) of `sessions`."""
    found = set()
    own = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == own:
            continue
        try:
            fields = _stat(name)
        except OSError:
            continue
        if fields[0] not in ("Z", "X") and int(fields[3]) in sessions:
            found.add(int(name))
    return found


def children(parent: int) -> list[int]:
    """The pids of the live (or unreaped) children of process `parent`, sorted."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = _stat(name)
        except OSError:
            continue
        if fields[1] == str(parent):
            found.append(int(name))
    return sorted(found)
