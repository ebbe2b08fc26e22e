"""The peer, measured beside wsync: vLLM 0.26's own packed IPC producer and its receiver's unpack.

On the GPU machine, with the vLLM bundle (`. .vllm/activate.sh`), after
`wsync tests/bench/canonical.lua > canonical.json` wrote the canonical tensors of a plan:

    python3 tests/bench/vllm_peer.py canonical.json [BUFFER_MIB] [REPEATS]

The tensors (every canonical tensor of the plan, in stream order, as bfloat16 views of one
trainer-side allocation) go through `vllm.distributed.weight_transfer.packed_tensor`'s
`packed_ipc_producer` with a 1 GiB buffer (vLLM's default), every chunk waited for as a
consumer would (the producer may not be resumed before the consumer read the chunk). The
receiver side is measured as vLLM's unpack of each chunk (`unpack_tensor` when the module has
it: split, view, and a clone of every tensor) on a local buffer of the same size: a lower
bound of vLLM's receiver, which then also calls the model's per-tensor `load_weights`
(not run here: that needs an engine). Prints the milliseconds of each, best of REPEATS.
"""
import inspect
import json
import sys
import time

import torch
from vllm.distributed.weight_transfer import packed_tensor


def main() -> None:
    canonical = json.load(open(sys.argv[1]))
    buffer_bytes = int(float(sys.argv[2]) * 1024 * 1024) if len(sys.argv) > 2 else 1024 ** 3
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    total = sum(tensor["elements"] for tensor in canonical)
    storage = torch.empty(total, dtype=torch.bfloat16, device="cuda")
    tensors, offset = [], 0
    for tensor in canonical:
        view = storage[offset:offset + tensor["elements"]].view(*tensor["shape"])
        tensors.append((tensor["name"], view))
        offset += tensor["elements"]
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    producer = packed_tensor.packed_ipc_producer
    print(f"vllm peer: {len(tensors)} tensors, {total * 2 / 1e9:.3f} GB, buffer {buffer_bytes} bytes; "
          f"packed_ipc_producer{inspect.signature(producer)}", flush=True)
    unpack = getattr(packed_tensor, "unpack_tensor", None)
    local = torch.empty(buffer_bytes, dtype=torch.uint8, device="cuda")

    def one_pass(receive: bool) -> tuple[float, int]:
        torch.cuda.synchronize()
        started = time.perf_counter()
        chunks = 0
        for chunk in producer(iter(tensors), uuid, post_iter_func=lambda item: item[1],
                              buffer_size_bytes=buffer_bytes):
            torch.cuda.synchronize()  # the consumer reads the chunk before the producer goes on
            chunks += 1
            if receive:
                sizes = list(chunk.tensor_sizes)
                packed = local[:sum(sizes)]
                dtypes = [getattr(torch, name) for name in chunk.dtype_names]
                if unpack is not None:
                    pieces = unpack(packed, chunk.names, chunk.shapes, dtypes, sizes)
                    pieces = [piece[1] if isinstance(piece, tuple) else piece for piece in pieces]
                else:
                    pieces = [part.contiguous().view(dtype).view(*shape)
                              for part, dtype, shape in zip(packed.split(sizes), dtypes, chunk.shapes)]
                clones = [piece.clone() for piece in pieces]  # vLLM's receiver clones every tensor
                torch.cuda.synchronize()
                del clones
        torch.cuda.synchronize()
        return (time.perf_counter() - started) * 1e3, chunks

    produce = min(one_pass(False)[0] for _ in range(repeats))
    both, chunks = min(one_pass(True) for _ in range(repeats))
    print(f"vllm packed_ipc_producer: {produce:.1f} ms for {chunks} chunks (best of {repeats})", flush=True)
    print(f"vllm producer + receiver's unpack and clone (no load_weights): {both:.1f} ms; receiver part "
          f"{both - produce:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
