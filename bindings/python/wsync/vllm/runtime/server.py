"""The serving end of wsync's control protocol over an inherited channel (fd 3): reads
one request at a time, runs its handler, answers. The host sends one request at a time
to a runtime and times each out itself; this end never answers out of order."""
from __future__ import annotations

import os
import select
import signal
import struct
import sys
import traceback
from typing import Any, Callable, Optional

from .. import protocol
from ..failure import Failure, fault_items

Handler = Callable[[dict[str, Any]], Optional[dict[str, Any]]]


#: Fault kinds of $WSYNC_RUNTIME_FAULT (scripts/wsync/control/fault.lua has the same spec).
FAULT_KINDS = ("crash", "hang", "stop", "stubborn", "eof", "wrong_id", "wrong_cmd", "wrong_protocol", "bad_result",
               "garbage", "oversize", "error")


class Faults:
    """Fault injection for tests: ``KIND@CMD[#N]`` items, comma-separated, make this process
    misbehave at the N-th (default first) request CMD, as the reference runtime's processes
    do (scripts/wsync/control/fault.lua), so that the host's fail-stop handling is proved
    against this runtime too. ``worker<R>:`` items name the reference runtime's own TP
    workers and are refused here."""

    def __init__(self, spec: str) -> None:
        self.items = [dict(item, nth=item["nth"] or 1, seen=0)
                      for item in fault_items(spec, FAULT_KINDS, "fault spec item",
                                              " (want KIND@CMD[#N]; this runtime has no worker<R>: items)")]

    def take(self, cmd: str) -> Optional[str]:
        """The fault kind to perform for this request of ``cmd``, or None (every item of the
        command counts it, so that #N is always the N-th request)."""
        kind = None
        for item in self.items:
            if item["cmd"] == cmd:
                item["seen"] += 1
                if item["seen"] == item["nth"] and kind is None:
                    kind = item["kind"]
        return kind


class Server:
    """Answers requests on ``fd`` with ``handlers`` (cmd -> function of the payload that
    returns the result). ``after_answer``, when a handler sets it, runs once the answer
    has been written (``shutdown`` closes then). ``idle``, when set, runs whenever no
    request is waiting, for as long as it answers True (there is more to do): a runtime's
    generation steps between its commands."""

    def __init__(self, handlers: dict[str, Handler], fd: int = 3, limit: int = protocol.MAX_FRAME,
                 name: str = "runtime", faults: "Faults | str" = "") -> None:
        self.handlers, self.fd, self.name, self.limit = handlers, fd, name, limit
        self.decoder = protocol.Decoder(limit)
        self.faults = faults if isinstance(faults, Faults) else Faults(faults)
        self.after_answer: Optional[Callable[[], None]] = None
        self.idle: Optional[Callable[[], bool]] = None
        self.closed = False

    def answer(self, message: dict[str, Any]) -> dict[str, Any]:
        """The response to one decoded message."""
        code, reason = protocol.check_request(message)
        if code:
            return protocol.failure(message, code, str(reason))
        handler = self.handlers.get(message["cmd"])
        if handler is None:
            return protocol.failure(message, "UNKNOWN_COMMAND", f"{self.name} has no command '{message['cmd']}' "
                                    f"(it has: {', '.join(sorted(self.handlers))})")
        payload = message.get("payload")
        try:
            result = handler(payload if isinstance(payload, dict) else {})
        except Failure as failed:
            return protocol.failure(message, failed.code, failed.message, fatal=failed.fatal or None,
                                    rank=failed.rank)
        except Exception as error:  # a bug or an engine failure: this process is not to be trusted
            return protocol.failure(message, "RUNTIME_ERROR", f"{message['cmd']}: {type(error).__name__}: {error}",
                                    fatal=True, traceback=traceback.format_exc())
        if result is not None and not isinstance(result, dict):
            return protocol.failure(message, "RUNTIME_ERROR", f"{message['cmd']} returned a "
                                    f"{type(result).__name__}, not an object", fatal=True)
        return protocol.success(message, result)

    def _inject(self, kind: str, message: dict[str, Any]) -> bool:
        """Misbehaves as ``kind`` says; True when the request gets no normal answer."""
        if kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # stopped, not dead: only SIGKILL ends it
        elif kind == "stubborn":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        elif kind == "eof":
            os.close(self.fd)
            self.closed = True
        elif kind == "garbage":
            self._write(b"\0\0\0\x0c{{not json}}")
        elif kind == "oversize":
            self._write(struct.pack(">I", self.limit + 1) + b"{")
        elif kind == "error":
            self._write(protocol.encode(protocol.failure(message, "INJECTED", f"injected failure of {message['cmd']}")))
        elif kind != "hang":
            return False  # wrong_id, wrong_cmd, wrong_protocol, bad_result alter the answer
        return True

    @staticmethod
    def _alter(kind: Optional[str], response: dict[str, Any]) -> dict[str, Any]:
        if kind == "wrong_id":
            response["id"] = response["id"] + 1000
        elif kind == "wrong_cmd":
            response["cmd"] = "not_" + response["cmd"]
        elif kind == "wrong_protocol":
            response["protocol"] = protocol.VERSION + 1
        elif kind == "bad_result":
            response["result"] = "not an object"
        return response

    def _write(self, frame: bytes) -> None:
        view = memoryview(frame)
        while view:
            written = os.write(self.fd, view)
            view = view[written:]

    def serve(self) -> str:
        """Serves until the host closes the channel or a handler asks to close; returns
        why it stopped: "EOF", "closed", or the framing error that ended it."""
        while not self.closed:
            if self.idle is not None:
                while not select.select([self.fd], [], [], 0)[0] and self.idle():
                    pass
            try:
                data = os.read(self.fd, 1 << 20)
            except OSError as error:
                return f"read failed: {error}"
            if not data:
                return "EOF"
            try:
                messages = self.decoder.push(data)
            except protocol.FrameError as error:
                print(f"wsync: {self.name}: {error}; closing the control channel", file=sys.stderr, flush=True)
                return str(error)
            for message in messages:
                kind = self.faults.take(str(message.get("cmd")))
                if kind is not None and self._inject(kind, message):
                    if self.closed:
                        return "closed"
                    continue
                response = self._alter(kind, self.answer(message))
                try:
                    self._write(protocol.encode(response))
                except ValueError as error:  # over the frame limit: say so within the limit
                    self._write(protocol.encode(protocol.failure(message, "RUNTIME_ERROR", str(error), fatal=True)))
                except OSError as error:
                    return f"write failed: {error}"
                if self.after_answer is not None:
                    after, self.after_answer = self.after_answer, None
                    after()
        return "closed"
