"""The receipt a TP worker returns at finish_update; wsync.vllm.contract checks them (the
runtime before it commits, the host again after)."""
from __future__ import annotations

from typing import Any


def receipt(header: dict[str, Any], tp_rank: int, uuid: str, manifest: str, tensors: int, nbytes: int,
            resident_tensors: int) -> dict[str, Any]:
    """The receipt a TP worker returns at finish: what it loaded for which publication."""
    return {
        "publication_id": header["publication_id"], "model_version": header["model_version"],
        "tp_rank": tp_rank, "tp_world": header["tp_world"], "uuid": uuid, "manifest": manifest,
        "tensors": tensors, "bytes": nbytes, "resident_tensors": resident_tensors,
    }
