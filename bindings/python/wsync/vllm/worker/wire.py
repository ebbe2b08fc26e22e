"""vLLM's packed IPC weight-update wire format, kept per vLLM version in this one module.

vLLM 0.26 (torch 2.11) takes, for one packed chunk, exactly these ``update_info`` keys:
``names``, ``dtype_names``, ``shapes``, ``packed`` (true), ``tensor_sizes``, and
``ipc_handles`` (GPU UUID -> the argument tuple of torch's ``rebuild_cuda_tensor`` for a uint8
tensor over the packed bytes) or ``ipc_handles_pickled``. Unknown keys are refused. Its consumer
rebuilds the tensor, takes ``sum(tensor_sizes)`` bytes from its start, and splits them back to
back. (vLLM 0.27+ moves ``packed`` to the init info and adds a per-rank list form: another
function here, chosen by version.) The tuple of torch's own, and the handle in it, come
from wsync.vllm.compat (``cuda_ipc_rebuild_args``).

wsync's buffers are plain ``cudaMalloc`` allocations exported with ``cudaIpcGetMemHandle``; a
descriptor is ``"<bytes>:<64-byte handle in hex>"`` (scripts/wsync/transport/cuda_ipc.lua). A
chunk's canonical tensors lie back to back in the buffer from their first offset, so one
chunk is one update (a gap would start another).
"""
from __future__ import annotations

from typing import Any, Sequence

from ..compat import IPC_HANDLE_BYTES, cuda_ipc_rebuild_args

#: The vLLM versions whose wire format this module writes, by the update builder.
VERSIONS = ("0.26",)


def parse_descriptor(descriptor: str) -> tuple[int, bytes]:
    """A wsync cuda_ipc buffer descriptor as (its bytes, its cudaIpcMemHandle_t)."""
    size, _, handle = descriptor.partition(":")
    try:
        raw = bytes.fromhex(handle)
        nbytes = int(size)
    except ValueError:
        raise ValueError(f"buffer descriptor {descriptor[:40]!r} is not <bytes>:<handle hex>") from None
    if len(raw) != IPC_HANDLE_BYTES or nbytes <= 0:
        raise ValueError(f"buffer descriptor {descriptor[:40]!r}: a {len(raw)}-byte handle of {nbytes} bytes "
                         f"(a cudaIpcMemHandle_t is {IPC_HANDLE_BYTES} bytes)")
    return nbytes, raw


def runs(tensors: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A chunk's tensors ({name, dtype, shape, offset, bytes}) in buffer order, split where
    one does not start where the one before ended (each run is one packed update)."""
    ordered = sorted(tensors, key=lambda tensor: tensor["offset"])
    result: list[list[dict[str, Any]]] = []
    end = None
    for tensor in ordered:
        if end is not None and tensor["offset"] < end:
            raise ValueError(f"{tensor['name']} at byte {tensor['offset']} overlaps the tensor before it "
                             f"(which ends at {end})")
        if end is None or tensor["offset"] != end:
            result.append([])
        result[-1].append(tensor)
        end = tensor["offset"] + tensor["bytes"]
    return result


def update_info_v026(torch: Any, run: Sequence[dict[str, Any]], uuid: str, descriptor: str,
                     ref_counter: bytes) -> dict[str, Any]:
    """vLLM 0.26's ``update_info`` for one run of a chunk read from the buffer ``descriptor``
    names, on the GPU ``uuid`` (torch's formatting)."""
    storage_bytes, handle = parse_descriptor(descriptor)
    start = run[0]["offset"]
    size = sum(tensor["bytes"] for tensor in run)
    if start + size > storage_bytes:
        raise ValueError(f"the chunk's bytes {start}..{start + size} lie beyond the {storage_bytes}-byte buffer")
    return {
        "names": [tensor["name"] for tensor in run],
        "dtype_names": [tensor["dtype"] for tensor in run],
        "shapes": [list(tensor["shape"]) for tensor in run],
        "packed": True,
        "tensor_sizes": [tensor["bytes"] for tensor in run],
        "ipc_handles": {uuid: cuda_ipc_rebuild_args(torch, handle, storage_bytes, start, size, ref_counter)},
    }
