"""The vllm runtime's end of its channels straight to each of vLLM's TP workers, beside
vLLM's ``collective_rpc`` (``runtime.channel = "socket"``).

Every weight command through ``collective_rpc`` crosses vLLM's EngineCore (its input
queue, its loop, its executor's broadcast to the workers and back): 1.3-2.2 ms a call on
the H200, paid once per chunk. Here each worker's extension serves a Unix socket from a
thread of its own (wsync.vllm.worker.channel) and the runtime sends a command to every
worker at once and reads their answers (``Channels``), in wsync's framing
(wsync.vllm.protocol). vLLM generates nothing meanwhile: the runtime refuses generation
between start and finish.
"""
from __future__ import annotations

import select
import socket
import time
from typing import Callable, Optional

from .. import protocol
from ..failure import Failure


class Channels:
    """The runtime's ends of every worker's channel, by rank."""

    def __init__(self, paths: list[str], timeout: float = 60.0) -> None:
        self.connections: list[socket.socket] = []
        try:
            for path in paths:
                connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.connections.append(connection)
                deadline = time.monotonic() + timeout
                while True:
                    try:
                        connection.connect(path)
                        break
                    except (FileNotFoundError, ConnectionRefusedError):
                        if time.monotonic() > deadline:
                            raise Failure("RUNTIME_START", f"no worker channel at {path} within {timeout:.0f} s",
                                          fatal=True) from None
                        time.sleep(0.01)
        except BaseException:
            self.close()
            raise
        self.decoders = [protocol.Decoder(protocol.MAX_FRAME) for _ in paths]

    def call(self, cmd: str, payload: str, timeout: float,
             dead: Callable[[], Optional[str]] = lambda: None) -> list[str]:
        """Sends ``cmd`` to every worker at once and returns their answers by rank (JSON
        strings). Fails with TIMEOUT past ``timeout`` seconds, ENGINE_DIED when ``dead()``
        names a process that died meanwhile or a worker closes its channel."""
        for rank, connection in enumerate(self.connections):
            try:
                protocol.send(connection, {"cmd": cmd, "payload": payload})
            except OSError as error:
                why = dead()
                raise Failure("ENGINE_DIED", f"TP worker {rank} closed its channel before {cmd} ({error}"
                              + (f"; {why})" if why else ")"), fatal=True, rank=rank) from None
        answers: list[Optional[str]] = [None] * len(self.connections)
        waiting = {connection.fileno(): rank for rank, connection in enumerate(self.connections)}
        deadline = time.monotonic() + timeout
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failure("TIMEOUT", f"TP workers {sorted(waiting.values())} did not answer {cmd} within "
                              f"{timeout:.0f} s", fatal=True)
            ready, _, _ = select.select(list(waiting), [], [], min(left, 0.2))
            if not ready:
                why = dead()
                if why:
                    raise Failure("ENGINE_DIED", f"{why} during {cmd}", fatal=True)
            for fileno in ready:
                rank = waiting[fileno]
                try:
                    data = self.connections[rank].recv(1 << 20)
                except OSError as error:  # (reset: the worker's process ended with the socket open)
                    why = dead()
                    raise Failure("ENGINE_DIED", f"TP worker {rank}'s channel broke during {cmd} ({error}"
                                  + (f"; {why})" if why else ")"), fatal=True, rank=rank) from None
                if not data:
                    why = dead()
                    raise Failure("ENGINE_DIED", f"TP worker {rank} closed its channel during {cmd}"
                                  + (f" ({why})" if why else ""), fatal=True, rank=rank)
                for message in self.decoders[rank].push(data):
                    answers[rank] = str(message.get("answer"))
                if answers[rank] is not None:
                    del waiting[fileno]
        return [answer for answer in answers if answer is not None]

    def close(self) -> None:
        for connection in self.connections:
            connection.close()
        self.connections = []
