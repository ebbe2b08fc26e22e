"""The TP worker's end of the vllm runtime's channel (``runtime.channel = "socket"``): the
worker's extension serves a Unix socket from a thread of its own, which runs the same
handler as ``collective_rpc`` would (the extension's ``wsync_command``) and owns the
worker's wsync host, so every weight command of the session goes through the channel once
it is open. The runtime's end is wsync.vllm.runtime.channels.
"""
from __future__ import annotations

import os
import socket
import threading
from typing import Callable, Optional

from .. import protocol


def serve(path: str, handle: Callable[[str, str], str], start: Optional[Callable[[], None]] = None) -> threading.Thread:
    """Listens on the Unix socket ``path`` and answers its one connection from a daemon
    thread: each request ``{cmd, payload}`` (the payload a JSON string) gets ``{answer}``,
    ``handle(cmd, payload)``'s JSON string. ``start`` runs first in that thread (the
    worker's CUDA device). The thread ends when the connection closes; the socket file is
    removed when the connection is made."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def run() -> None:
        try:
            if start is not None:
                start()
            connection, _ = listener.accept()
        finally:
            listener.close()
            try:
                os.unlink(path)
            except OSError:
                pass
        decoder = protocol.Decoder(protocol.MAX_FRAME)
        with connection:
            try:
                while True:
                    data = connection.recv(1 << 20)
                    if not data:
                        return
                    for message in decoder.push(data):
                        answer = handle(str(message.get("cmd")), str(message.get("payload")))
                        protocol.send(connection, {"answer": answer})
            except (OSError, protocol.FrameError):
                return  # (the runtime went away, or broke the stream: it is being destroyed)

    thread = threading.Thread(target=run, name=f"wsync-channel-{os.path.basename(path)}", daemon=True)
    thread.start()
    return thread
