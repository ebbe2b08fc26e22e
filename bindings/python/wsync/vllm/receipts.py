"""Per-worker receipts of a publication, checked by the runtime before it commits (the host
checks them again: scripts/wsync/publish/receipts.lua has the same rules)."""
from __future__ import annotations

from typing import Any, Optional

from .server import Failure


def receipt(header: dict[str, Any], tp_rank: int, uuid: str, manifest: str, tensors: int, nbytes: int,
            resident_tensors: int) -> dict[str, Any]:
    """The receipt a TP worker returns at finish: what it loaded for which publication."""
    return {
        "publication_id": header["publication_id"], "model_version": header["model_version"],
        "tp_rank": tp_rank, "tp_world": header["tp_world"], "uuid": uuid, "manifest": manifest,
        "tensors": tensors, "bytes": nbytes, "resident_tensors": resident_tensors,
    }


def check_receipts(header: dict[str, Any], receipts: list[dict[str, Any]],
                   resident_tensors: Optional[list[int]] = None) -> None:
    """Raises a fatal RECEIPT_INVALID naming the rank and the field unless there is one
    receipt per TP rank, in order, each for this publication and version, on the device the
    header names, having consumed exactly the expected manifest and (when the header says
    how many) filled every resident tensor."""
    world = header["tp_world"]
    if len(receipts) != world:
        raise Failure("RECEIPT_INVALID", f"{len(receipts)} receipts for TP {world}", fatal=True)
    for rank, got in enumerate(receipts):
        def invalid(message: str) -> Failure:
            return Failure("RECEIPT_INVALID", f"receipt of TP rank {rank}: {message}", fatal=True, rank=rank)
        if got.get("publication_id") != header["publication_id"]:
            raise invalid(f"publication id {got.get('publication_id')} is not {header['publication_id']}")
        if got.get("model_version") != header["model_version"]:
            raise invalid(f"model version {got.get('model_version')} is not {header['model_version']}")
        if got.get("tp_rank") != rank or got.get("tp_world") != world:
            raise invalid(f"claims TP rank {got.get('tp_rank')} of {got.get('tp_world')}")
        if got.get("uuid") != header["uuids"][rank]:
            raise invalid(f"device {got.get('uuid')}, the header says {header['uuids'][rank]}")
        if got.get("manifest") != header["manifest"]:
            raise invalid(f"consumed manifest {got.get('manifest')}, expected {header['manifest']}")
        if resident_tensors is not None and got.get("resident_tensors") != resident_tensors[rank]:
            raise invalid(f"filled {got.get('resident_tensors')} resident tensors of {resident_tensors[rank]}")
