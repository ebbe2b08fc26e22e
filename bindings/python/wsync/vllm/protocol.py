"""wsync's control protocol, the Python end (the wire of scripts/wsync/control/protocol.lua).

A frame is a 4-byte big-endian length followed by that many bytes of JSON. A request is
``{protocol, id, cmd, payload}``; a response echoes ``protocol, id, cmd`` and carries
``ok = true, result = {...}`` or ``ok = false, error = {code, message, traceback?, fatal?}``.
A frame over the size limit, or one that is not a JSON object, ends the connection.
"""
from __future__ import annotations

import json
import struct
from typing import Any, Optional

#: The protocol version this package speaks (wsync.control.protocol.VERSION).
VERSION = 1

#: Default hard limit on one frame's body, in bytes.
MAX_FRAME = 16 * 1024 * 1024

#: Request ids are integers from 0 to 2^53 (what a Lua number holds exactly).
MAX_ID = 2 ** 53


class FrameError(Exception):
    """The byte stream is bad: an oversize frame or an undecodable body. The connection
    cannot be used again."""


def encode(message: dict[str, Any], limit: int = MAX_FRAME) -> bytes:
    """Encodes one message as a frame; raises ValueError when its body exceeds ``limit``,
    so that the sender learns before the peer breaks."""
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > limit:
        raise ValueError(f"frame of {len(body)} bytes exceeds the {limit}-byte limit")
    return struct.pack(">I", len(body)) + body


def send(connection: Any, message: dict[str, Any]) -> None:
    """Sends one message as a frame on a connected socket (the runtime's channels to its TP
    workers, both ends)."""
    connection.sendall(encode(message))


class Decoder:
    """A streaming decoder: ``push(data)`` returns the complete messages so far. Once the
    stream is bad every push raises FrameError with the same reason."""

    def __init__(self, limit: int = MAX_FRAME) -> None:
        self.limit = limit
        self._buffer = bytearray()
        self._failed: Optional[str] = None

    def push(self, data: bytes) -> list[dict[str, Any]]:
        if self._failed:
            raise FrameError(self._failed)
        self._buffer += data
        messages = []
        while len(self._buffer) >= 4:
            (length,) = struct.unpack_from(">I", self._buffer)
            if length > self.limit:
                self._failed = f"frame of {length} bytes exceeds the {self.limit}-byte limit"
                raise FrameError(self._failed)
            if len(self._buffer) < 4 + length:
                break
            body = bytes(self._buffer[4:4 + length])
            del self._buffer[:4 + length]
            try:
                message = json.loads(body)
            except ValueError as error:
                self._failed = f"undecodable frame: {error}"
                raise FrameError(self._failed) from None
            if not isinstance(message, dict):
                self._failed = f"undecodable frame: a JSON {type(message).__name__}, not an object"
                raise FrameError(self._failed)
            messages.append(message)
        return messages


def _is_id(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
            and 0 <= value <= MAX_ID and float(value).is_integer())


def check_request(message: dict[str, Any]) -> tuple[Optional[str], Optional[str]]:
    """Checks a received request; returns (None, None), or (code, reason) for what is
    wrong. A version mismatch is reported as such so that the server refuses clearly."""
    if message.get("protocol") != VERSION:
        return "PROTOCOL_MISMATCH", f"peer speaks protocol {message.get('protocol')}, this side speaks {VERSION}"
    request_id, cmd = message.get("id"), message.get("cmd")
    if isinstance(request_id, bool) or not isinstance(request_id, (int, float)) or not isinstance(cmd, str):
        return "BAD_REQUEST", "request without a numeric id and a string cmd"
    if not _is_id(request_id):
        return "BAD_REQUEST", f"request id {request_id} is not an integer from 0 to 2^53"
    payload = message.get("payload")
    if payload is not None and not isinstance(payload, (dict, list)):
        return "BAD_REQUEST", "request payload is not an object"
    return None, None


def success(request: dict[str, Any], result: Optional[dict[str, Any]]) -> dict[str, Any]:
    """The successful response to ``request``."""
    return {"protocol": VERSION, "id": request["id"], "cmd": request["cmd"], "ok": True, "result": result or {}}


def failure(request: dict[str, Any], code: str, message: str, **fields: Any) -> dict[str, Any]:
    """The failed response to ``request``. ``fatal = True`` tells the host that this process
    can no longer be trusted (it destroys the process tree). A request that
    check_request refused is answered with its id when that is valid, else 0."""
    request_id = request.get("id")
    error = {"code": code, "message": message}
    error.update({key: value for key, value in fields.items() if value is not None})
    return {"protocol": VERSION, "id": request_id if _is_id(request_id) else 0, "cmd": str(request.get("cmd")),
            "ok": False, "error": error}
