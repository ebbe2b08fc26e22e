"""The one error of the vllm runtime's two processes (its main process, wsync.vllm.runtime,
and the code inside vLLM's TP workers, wsync.vllm.worker) and the one parser of their fault
specs."""
from __future__ import annotations

from typing import Any, Optional

from ..errors import WsyncError


class Failure(WsyncError):
    """A command failed. ``fatal``: this process can no longer be trusted (the host
    destroys its tree); otherwise only the command was refused. ``rank``: the TP rank
    that failed, when one did. A WsyncError, as every exception of the package: its text
    "MESSAGE (CODE)", its code ``code``."""

    def __init__(self, code: str, message: str, fatal: bool = False, rank: Optional[int] = None) -> None:
        super().__init__(f"{message} ({code})", "EFAILED")
        self.code, self.message, self.fatal, self.rank = code, message, fatal, rank
        self.fields = {"fatal": fatal} if rank is None else {"fatal": fatal, "rank": rank}

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


def fault_items(spec: str, kinds: "tuple[str, ...]", what: str, usage: str = "") -> list[dict[str, Any]]:
    """The items of a fault spec, comma-separated ``KIND@CMD[#N]`` (N absent: None), each
    KIND one of ``kinds``; raises ValueError "bad WHAT 'ITEM'USAGE" for any other item. The
    one parser of the Python side's fault specs (this runtime's $WSYNC_RUNTIME_FAULT and
    the engine's $WSYNC_VLLM_FAULT), the grammar of scripts/wsync/control/fault.lua's."""
    items = []
    for item in filter(None, spec.split(",")):
        kind, _, where = item.partition("@")
        cmd, hash_, nth = where.partition("#")
        if kind not in kinds or not cmd or not (cmd.replace("_", "").isalnum() and cmd.isascii()) \
                or (hash_ and not (nth.isdigit() and nth.isascii())):
            raise ValueError(f"bad {what} '{item}'{usage}")
        items.append({"kind": kind, "cmd": cmd, "nth": int(nth) if hash_ else None})
    return items
