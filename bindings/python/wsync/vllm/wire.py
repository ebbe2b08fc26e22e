"""vLLM's packed IPC weight-update wire format, kept per vLLM version in this one module.

vLLM 0.26 (torch 2.11) takes, for one packed chunk, exactly these ``update_info`` keys:
``names``, ``dtype_names``, ``shapes``, ``packed`` (true), ``tensor_sizes``, and
``ipc_handles`` (GPU UUID -> the argument tuple of torch's ``rebuild_cuda_tensor`` for a uint8
tensor over the packed bytes) or ``ipc_handles_pickled``. Unknown keys are refused. Its consumer
rebuilds the tensor, takes ``sum(tensor_sizes)`` bytes from its start, and splits them back to
back. (vLLM 0.27+ moves ``packed`` to the init info and adds a per-rank list form: another
function here, chosen by version.)

wsync's buffers are plain ``cudaMalloc`` allocations exported with ``cudaIpcGetMemHandle``; a
descriptor is ``"<bytes>:<64-byte handle in hex>"`` (scripts/wsync/transport/cuda_ipc.lua). A
chunk's canonical tensors lie back to back in the buffer from their first offset, so one
chunk is one update (a gap would start another).
"""
from __future__ import annotations

from typing import Any, Sequence

#: torch's shareable-handle version that torch 2.11 to 2.13 all read.
HANDLE_VERSION = 2
#: The handle type of a plain cudaMalloc block.
HANDLE_TYPE = b"c"
IPC_HANDLE_BYTES = 64

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


def storage_handle(ipc_handle: bytes) -> bytes:
    """The storage handle torch's CUDA caching allocator shares: version, type, handle."""
    if len(ipc_handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"a cudaIpcMemHandle_t is {IPC_HANDLE_BYTES} bytes, not {len(ipc_handle)}")
    return bytes([HANDLE_VERSION]) + HANDLE_TYPE + ipc_handle


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


def rebuild_args(torch: Any, ipc_handle: bytes, storage_bytes: int, offset: int, nbytes: int,
                 ref_counter: bytes) -> tuple:
    """torch's ``rebuild_cuda_tensor`` arguments for ``nbytes`` uint8 elements from byte
    ``offset`` of a whole exported buffer. The device index (6) is the consumer's to set. The
    producer synchronized before sending: no event to wait on. ``ref_counter`` names a
    shared-memory file the consumer decrements when it lets go (best effort in torch: a
    missing file is ignored)."""
    return (torch.Tensor, torch.Size([nbytes]), (1,), offset, torch.storage.TypedStorage, torch.uint8, 0,
            storage_handle(ipc_handle), storage_bytes, 0, False, ref_counter, 0, b"", False)


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
        "ipc_handles": {uuid: rebuild_args(torch, handle, storage_bytes, start, size, ref_counter)},
    }
