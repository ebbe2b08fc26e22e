"""The calling thread's SIGPIPE as the kernel sees it (/proc/thread-self/status), for the
checks that wsync leaves a trainer's signals as it found them: Python's own
``signal.getsignal`` only knows what Python set, not what a library changed under it."""
from __future__ import annotations

import signal

_BIT = 1 << (signal.SIGPIPE - 1)


def sigpipe() -> dict[str, bool]:
    """``{ignored, blocked, pending}``: SIGPIPE's disposition is SIG_IGN, this thread
    blocks it, it is pending for this thread or the process."""
    fields = {}
    with open("/proc/thread-self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("SigIgn", "SigBlk", "SigPnd", "ShdPnd"):
                fields[key] = int(value.strip(), 16)
    return {"ignored": bool(fields["SigIgn"] & _BIT), "blocked": bool(fields["SigBlk"] & _BIT),
            "pending": bool((fields["SigPnd"] | fields["ShdPnd"]) & _BIT)}
