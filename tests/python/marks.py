"""The processes that carry a mark in their environment (``NAME=VALUE``), found through
/proc: how the tests see every process a run started, short-lived children included
(conftest's sessions, tests/gpu/vllm_faults.py). No pytest here: GPU scripts import it."""
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
