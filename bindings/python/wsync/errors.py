"""wsync's exceptions: each carries the C status, and wsync's error code, phase and rank
when the host's error text names them (``[phase P, rank R] message (CODE, cause C)``)."""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from ._native import STATUS_NAMES

_CONTEXT = re.compile(r"\[(?:phase (?P<phase>[^,\]]+))?(?:, )?(?:rank (?P<rank>\d+))?\] ")
_CODE = re.compile(r"\((?P<code>[A-Z][A-Z0-9_]*)(?:, cause (?P<cause>[^)]*))?\)\s*$")


class WsyncError(Exception):
    """A wsync call failed.

    Attributes:
        status: the C status name (``"EFAILED"``, ``"EINVAL"``, ...; bindings/wsync.h).
        code: wsync's error code (``"PUBLISH_FAILED"``, ``"MISSING_TENSOR"``, ...) or None.
        phase: the publication or schedule phase the error names, or None.
        rank: the trainer rank the error names, or None.
        cause: the underlying code the error names (``cause C``), or None.
        text: the whole error text, as wsync wrote it.
    """

    def __init__(self, text: str, status: str = "EFAILED", call: str = ""):
        self.text = text
        self.status = status
        self.call = call
        first_line = text.split("\n", 1)[0]
        context = _CONTEXT.search(first_line)
        self.phase: Optional[str] = context.group("phase") if context else None
        self.rank: Optional[int] = int(context.group("rank")) if context and context.group("rank") else None
        code = _CODE.search(first_line)
        self.code: Optional[str] = code.group("code") if code else None
        self.cause: Optional[str] = code.group("cause") if code else None
        #: The error's other fields, when it came as an object (Host.call): fatal, field, ...
        self.fields: dict[str, Any] = {}
        super().__init__(f"{call}: {text}" if call and not text.startswith(call) else text)


class InvalidArgument(WsyncError, ValueError):
    """A bad argument (EINVAL): a wrong shape, dtype or name; nothing was changed."""


class StateError(WsyncError, RuntimeError):
    """A call out of order (ESTATE): before ready, after close, inside a step callback."""


def from_status(status: int, text: str, call: str = "") -> WsyncError:
    """The exception for a negative status of the C API and its error text."""
    name = STATUS_NAMES.get(status, str(status))
    kind = {"EINVAL": InvalidArgument, "ESTATE": StateError}.get(name, WsyncError)
    return kind(text or "(no error text)", name, call)


#: The codes of a refusal of what the caller gave: InvalidArgument.
CALLER_CODES = frozenset({"RECIPE_INVALID", "SCRIPT_INVALID", "USAGE", "INVALID_ARGUMENT"})


def from_error(error: Mapping[str, Any], call: str = "") -> WsyncError:
    """The exception for an error object of wsync's JSON seam (``Host.call``: {code,
    message, fields}): the same text as the C API's ("MESSAGE (CODE[, cause C])"), code,
    phase, rank and cause from the fields, every field in ``fields``."""
    code = str(error.get("code") or "FAILED")
    fields = dict(error.get("fields") or {})
    cause = fields.get("cause")
    suffix = f"{code}, cause {cause}" if cause is not None and cause != code else code
    kind = InvalidArgument if code in CALLER_CODES else WsyncError
    failure = kind(f"{error.get('message', '(no message)')} ({suffix})", "EINVAL" if kind is InvalidArgument
                   else "EFAILED", call)
    failure.fields = fields
    if fields.get("phase") is not None:
        failure.phase = str(fields["phase"])
    if isinstance(fields.get("rank"), int):
        failure.rank = fields["rank"]
    return failure
