"""The runtime contract, stateless: what a rollout runtime checks of a publication header at
start_update, of its TP workers' receipts before it commits, and what the host checks of a
runtime's finish_update answer. The Python twin of scripts/wsync/runtime/contract.lua, with
the same rules, codes and messages; tests/fixtures/contract/*.json holds the cases both are
tested on (tests/python/test_contract.py, tests/unit/scripts/runtime/contract_spec.lua)."""
from __future__ import annotations

import re
from typing import Any, Optional

from .failure import Failure

_HEX = re.compile(r"[0-9a-fA-F]+")


def show(value: Any) -> str:
    """How a value the contract refuses appears in its message, as the Lua side writes it:
    None as "nil", a boolean as "true"/"false", an integral number without a fraction, a
    string as it is, a list or an object as "(a table)"."""
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 2 ** 53 else f"{value:.17g}"
    if isinstance(value, (list, dict, tuple)):
        return "(a table)"
    return str(value)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integral(value: Any) -> bool:
    return _number(value) and float(value).is_integer()


def _hex(value: Any, digits: int) -> bool:
    return isinstance(value, str) and len(value) == digits and _HEX.fullmatch(value) is not None


def _same(a: Any, b: Any) -> bool:
    """Equality as Lua's ``==`` sees JSON values: numbers by value (never a boolean), the
    rest by type and value."""
    if _number(a) and _number(b):
        return a == b
    return type(a) is type(b) and a == b


def check_header(header: Any, runtime: dict[str, Any]) -> None:
    """Checks a publication header against the runtime that receives it: ``runtime`` is
    {protocol, transport, committed, tp_world, uuids}, the protocol it speaks, the transport
    of the buffers it imported, the version it committed last (0 for none), its TP world and
    its workers' device UUIDs by rank. Raises a fatal BAD_HEADER."""
    def bad(message: str) -> Failure:
        return Failure("BAD_HEADER", message, fatal=True)
    if isinstance(header, list):
        header = {}  # (a table in Lua too: its fields are missing)
    if not isinstance(header, dict):
        raise bad("start_update without a publication header")
    if not _same(header.get("protocol"), runtime["protocol"]):
        raise bad(f"header for protocol {show(header.get('protocol'))}; this runtime speaks "
                  f"{show(runtime['protocol'])}")
    if not _same(header.get("transport"), runtime["transport"]):
        raise bad(f"header for transport {show(header.get('transport'))}; the buffers this runtime imported are "
                  f"{show(runtime['transport'])}")
    if not _hex(header.get("publication_id"), 32):
        raise bad(f"publication id {show(header.get('publication_id'))} is not 128 bits in hex")
    version = header.get("model_version")
    if not _integral(version) or version <= runtime["committed"]:
        raise bad(f"model version {show(version)} does not follow the committed version {show(runtime['committed'])}")
    if not _hex(header.get("manifest"), 64):
        raise bad(f"manifest {show(header.get('manifest'))} is not a SHA-256 in hex")
    uuids = header.get("uuids")
    if not isinstance(uuids, (list, dict)):
        raise bad("header without the ordered device UUIDs")
    if not _same(header.get("tp_world"), runtime["tp_world"]):
        raise bad(f"header for TP {show(header.get('tp_world'))}, runtime has {show(runtime['tp_world'])} workers")
    for rank, uuid in enumerate(runtime["uuids"]):
        named = uuids[rank] if isinstance(uuids, list) and rank < len(uuids) else None
        if not _same(named, uuid):
            raise bad(f"header puts rank {rank} on device {show(named)}; TP worker {rank} is on {uuid}")


def check_receipts(header: dict[str, Any], receipts: Any, resident_tensors: Optional[list[int]] = None) -> None:
    """Checks the TP workers' receipts against the publication header: one per TP rank, in
    order, each for this publication and version, on the device the header names, having
    consumed exactly the expected manifest and (when ``resident_tensors`` is given) filled
    every resident tensor. Raises a fatal RECEIPT_INVALID naming the rank and the field."""
    world = header.get("tp_world")
    if not isinstance(receipts, list) or not _same(len(receipts), world):
        # (An object is a table in Lua too, of no items.)
        count = show(len(receipts)) if isinstance(receipts, list) else "0" if isinstance(receipts, dict) else "no"
        raise Failure("RECEIPT_INVALID", f"{count} receipts for TP {show(world)}", fatal=True)
    uuids = header.get("uuids")
    uuids = uuids if isinstance(uuids, list) else []
    for rank, got in enumerate(receipts):
        def invalid(message: str) -> Failure:
            return Failure("RECEIPT_INVALID", f"receipt of TP rank {rank}: {message}", fatal=True, rank=rank)
        if isinstance(got, list):
            got = {}  # (a table in Lua too: its fields are missing)
        if not isinstance(got, dict):
            raise invalid("not an object")
        named = uuids[rank] if rank < len(uuids) else None
        if not _same(got.get("publication_id"), header.get("publication_id")):
            raise invalid(f"publication id {show(got.get('publication_id'))} is not {show(header.get('publication_id'))}")
        if not _same(got.get("model_version"), header.get("model_version")):
            raise invalid(f"model version {show(got.get('model_version'))} is not {show(header.get('model_version'))}")
        if not _same(got.get("tp_rank"), rank) or not _same(got.get("tp_world"), world):
            raise invalid(f"claims TP rank {show(got.get('tp_rank'))} of {show(got.get('tp_world'))}")
        if not _same(got.get("uuid"), named):
            raise invalid(f"device {show(got.get('uuid'))}, the header says {show(named)}")
        if not _same(got.get("manifest"), header.get("manifest")):
            raise invalid(f"consumed manifest {show(got.get('manifest'))}, expected {show(header.get('manifest'))}")
        if resident_tensors is not None:
            expected = resident_tensors[rank] if rank < len(resident_tensors) else None
            if not _same(got.get("resident_tensors"), expected):
                raise invalid(f"filled {show(got.get('resident_tensors'))} resident tensors of {show(expected)}")


def check_finish(header: dict[str, Any], result: dict[str, Any]) -> None:
    """Checks a runtime's answer to finish_update for ``header`` (the host's check after the
    runtime's own): the version it committed, the reset of its prefix cache, and every
    receipt (check_receipts against the header's resident counts). Raises
    RECEIPT_INVALID."""
    if not _same(result.get("model_version"), header.get("model_version")):
        raise Failure("RECEIPT_INVALID", f"the runtime committed version {show(result.get('model_version'))}, not "
                      f"{show(header.get('model_version'))}")
    if result.get("prefix_cache_reset") is not True:
        raise Failure("RECEIPT_INVALID", "the runtime committed without resetting its prefix cache (cached prefixes "
                      "of the old weights would be served)")
    check_receipts(header, result.get("receipts"), header.get("resident_tensors"))
