"""wsync against vLLM's own weight sync, into real vLLM, in one run (issue 11's benchmark).

On the GPU machine with the vLLM bundle (`. .vllm/activate.sh`) and the wsync bundle's
environment (`. build/bundle/env.sh`):

    python3 tests/bench/vllm_publish.py [REPEATS]

The Qwen3-30B-A3B shape (18,867 canonical tensors, 61.06 GB in bfloat16), TP1, one H200,
vLLM with dummy weights. The trainer's tensors are the transformers-v5 layout (packed
experts) as views of one allocation; the same tensors go four ways, in this order:

1. the floor: one flat device copy of all the bytes (torch's copy_);
2. vLLM's own path: `IPCWeightTransferEngine.trainer_send_weights(packed=True, 1 GiB)` into an
   `LLM` in this process, between `start_weight_update` and `finish_weight_update` (the
   canonical tensors as views of the trainer's storage; the update goes to vLLM as
   `ipc_handles_pickled`, which needs VLLM_ALLOW_INSECURE_SERIALIZATION=1);
3. wsync, load = "native" (tests/fixtures/recipes/vllm_30b_bench_native.lua);
4. wsync, load = "direct" (tests/fixtures/recipes/vllm_30b_bench.lua; its first publication
   also checks the plan against vLLM's own loader, reported apart);
5. the same with two 4 GiB buffers rather than 1 GiB (tests/fixtures/recipes/vllm_30b_bench_4g.lua);
6. direct from the trainer's own storage: no packed buffers, one chunk
   (tests/fixtures/recipes/vllm_30b_bench_storage.lua; its first publication checked too);
7. direct as 4., its weight commands over wsync's socket to the worker rather than vLLM's
   collective_rpc (tests/fixtures/recipes/vllm_30b_bench_socket.lua);
8. direct as 6. over that socket (tests/fixtures/recipes/vllm_30b_bench_storage_socket.lua);
9. direct through one 8 GiB buffer with the chunks ordered on the device (buffers.order =
   "device": tests/fixtures/recipes/vllm_30b_bench_ordered.lua);
10. FP8 rollout (issue 24, item 5): vLLM holding its online per-tensor FP8 of the same bfloat16
   (runtime.vllm.quantization = "fp8"), "fp8 direct" (wsync's direct loader quantizing as it
   copies, tests/fixtures/recipes/vllm_30b_bench_fp8.lua; its first publication checked
   against vLLM's own FP8 loader), "fp8 direct storage" (the same from the trainer's own
   storage, tests/fixtures/recipes/vllm_30b_bench_storage_fp8.lua) and "fp8 native" (vLLM's loader quantizing,
   tests/fixtures/recipes/vllm_30b_bench_native_fp8.lua); with either, vLLM's own update runs
   into an FP8 engine too, and their ratios are to it. With a direct FP8 way one line sums up
   the faster: ``fp8 publish 30B-A3B direct: X ms = R x the bf16 floor (F ms), S x faster than
   vLLM's own (V ms) (wsync WAY)`` (the floor is the bfloat16 flat copy of 1.; V is vLLM's own
   FP8 update).

    python3 tests/bench/vllm_publish.py [REPEATS] [WAY,WAY,...]
WAYS: of native, direct, "direct 2x4GiB", "direct storage", "direct socket", "direct storage socket",
"direct ordered", "fp8 direct", "fp8 direct storage", "fp8 native" (default all); the floor always runs,
vLLM's own update into bf16 when a bf16 way is among them, and into FP8 when an FP8 way is
(so that the FP8 ways, native included, fit one device call beside vLLM's own).

A way that fails is reported and the others still run. With native among the ways, vLLM's own
runs again after them (its time moves by a second from one engine to the next: 4.2-6.1 s on the
same machine), and the ratios are to the best of all its runs.

Each is timed REPEATS times (default 3) after one warm-up; each vLLM engine is shut down
before the next starts. Prints a table in milliseconds with the split of wsync's publications
and the ratios to the floor and to vLLM's own: fill (the trainer's copies into the packed
buffers, overlapping the loads), load (each chunk's load request through vLLM), of which
copies (the loader's own copy time in vLLM's workers), finish (receipts, commit, prefix
cache), control (load - copies + finish: the round trips that are no copy), start (the start
phase: the header to every worker, which binds vLLM's parameters where they lie now).
"""
from __future__ import annotations

import base64
import gc
import os
import pickle
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "recipes" / "models" / "qwen3-30b-a3b"
RECIPES = {"native": "tests/fixtures/recipes/vllm_30b_bench_native.lua",
           "direct": "tests/fixtures/recipes/vllm_30b_bench.lua",
           "direct 2x4GiB": "tests/fixtures/recipes/vllm_30b_bench_4g.lua",
           "direct storage": "tests/fixtures/recipes/vllm_30b_bench_storage.lua",
           "direct socket": "tests/fixtures/recipes/vllm_30b_bench_socket.lua",
           "direct storage socket": "tests/fixtures/recipes/vllm_30b_bench_storage_socket.lua",
           "direct ordered": "tests/fixtures/recipes/vllm_30b_bench_ordered.lua",
           "fp8 direct": "tests/fixtures/recipes/vllm_30b_bench_fp8.lua",
           "fp8 direct storage": "tests/fixtures/recipes/vllm_30b_bench_storage_fp8.lua",
           "fp8 native": "tests/fixtures/recipes/vllm_30b_bench_native_fp8.lua"}
GiB = 1024 ** 3


def say(text: str) -> None:
    print(f"vllm_publish: {text}", flush=True)


def trainer_storage(wsync, recipe: str = RECIPES["direct"]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The trainer's tensors (the recipe's layout), views of one bfloat16 allocation on the
    device, random values (tests/bench/rl_step.py's too)."""
    layout = wsync.trainer_tensors(recipe)
    total = sum(int(torch.Size(t.shape).numel()) for t in layout)
    storage = torch.empty(total, dtype=torch.bfloat16, device="cuda")
    storage.normal_(0, 0.02)
    tensors, offset = {}, 0
    for t in layout:
        count = int(torch.Size(t.shape).numel())
        tensors[t.name] = storage[offset:offset + count].view(t.shape)
        offset += count
    return storage, tensors


def canonical(tensors: dict[str, torch.Tensor], config: dict) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint-format stream vLLM's loader takes: per-expert views of the packed experts."""
    out = []
    inter = config["moe_intermediate_size"]
    for name, tensor in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e in range(tensor.shape[0]):
                out.append((f"{prefix}{e}.gate_proj.weight", tensor[e, :inter]))
                out.append((f"{prefix}{e}.up_proj.weight", tensor[e, inter:]))
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                out.append((f"{prefix}{e}.down_proj.weight", tensor[e]))
        else:
            out.append((name, tensor))
    return out


def timed(run, repeats: int) -> list[float]:
    run()
    seconds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return seconds


def vllm_own(stream: list[tuple[str, torch.Tensor]], repeats: int, **engine: str) -> list[float]:
    """vLLM's own packed IPC update of ``stream`` (bfloat16) into an LLM of ``engine``'s
    arguments beside the fixed ones (``quantization="fp8"``: vLLM quantizes as it loads)."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerSendWeightsArgs, IPCWeightTransferEngine
    llm = LLM(model=str(MODEL), load_format="dummy", enforce_eager=True, skip_tokenizer_init=True,
              gpu_memory_utilization=0.47, max_model_len=1024,
              weight_transfer_config=WeightTransferConfig(backend="ipc"), **engine)
    llm.init_weight_transfer_engine({"init_info": {}})

    def send(info) -> None:
        llm.update_weights({"update_info": {
            "names": info.names, "dtype_names": info.dtype_names, "shapes": info.shapes, "packed": True,
            "tensor_sizes": info.tensor_sizes,
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(info.ipc_handles)).decode()}})

    def once() -> None:
        llm.start_weight_update()
        IPCWeightTransferEngine.trainer_send_weights(iter(stream), IPCTrainerSendWeightsArgs(
            send_mode=send, packed=True, packed_buffer_size_bytes=GiB))
        llm.finish_weight_update()

    seconds = timed(once, repeats)
    from wsync.vllm.compat import shutdown_engine_core
    shutdown_engine_core(llm)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return seconds


def wsync_way(wsync, tensors: dict[str, torch.Tensor], way: str, repeats: int) -> list[dict]:
    with wsync.Host(RECIPES[way]) as host:
        agent = host.agent(rank=0, world=1, backend="cuda", device=0)
        for name, tensor in tensors.items():
            agent.register_tensor(name, tensor)
        agent.ready()
        for step in range(1, repeats + 2):
            agent.publish(step)
        return host.reports()


def main() -> int:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    ways = sys.argv[2].split(",") if len(sys.argv) > 2 else list(RECIPES)
    unknown = sorted(set(ways) - set(RECIPES))
    if unknown:
        say(f"unknown ways {unknown} (known: {', '.join(RECIPES)})")
        return 2
    os.chdir(ROOT)
    import json
    import wsync
    torch.cuda.set_device(0)
    config = json.loads((MODEL / "config.json").read_text())
    storage, tensors = trainer_storage(wsync)
    stream = canonical(tensors, config)
    nbytes = storage.numel() * 2
    say(f"{len(tensors)} trainer tensors, {len(stream)} canonical, {nbytes / 1e9:.2f} GB; {torch.cuda.get_device_name()}")
    target = torch.empty_like(storage)
    floor = timed(lambda: target.copy_(storage), repeats)
    del target
    torch.cuda.empty_cache()
    say(f"floor (one flat copy): {min(floor) * 1e3:.1f} ms")
    own = []
    if not all(way.startswith("fp8") for way in ways):  # (FP8 ways are held against vLLM's own into FP8 alone)
        own = vllm_own(stream, repeats)
        say(f"vLLM's own packed IPC update: {min(own) * 1e3:.1f} ms (of {', '.join(f'{s * 1e3:.0f}' for s in own)})")
    rows = {}
    for way in ways:
        try:
            reports = wsync_way(wsync, tensors, way, repeats)
        except Exception as error:  # (reported; the other ways still run)
            say(f"wsync {way}: FAILED: {type(error).__name__}: {error}")
            continue
        rows[way] = reports
        for report in reports:
            t = report["timings"]
            say(f"wsync {way} version {report['model_version']}: total {t['total'] * 1e3:.1f} ms (init "
                f"{t['init'] * 1e3:.1f}, fill {t['fill'] * 1e3:.1f}, load {t['load'] * 1e3:.1f}, finish "
                f"{t['finish'] * 1e3:.1f})")
    again = []
    if "native" in ways:
        again = vllm_own(stream, repeats)
        say(f"vLLM's own packed IPC update, again: {min(again) * 1e3:.1f} ms (of "
            f"{', '.join(f'{s * 1e3:.0f}' for s in again)})")
    own_fp8 = []
    if any(way.startswith("fp8") for way in ways):
        own_fp8 = vllm_own(stream, repeats, quantization="fp8")
        say(f"vLLM's own packed IPC update into FP8: {min(own_fp8) * 1e3:.1f} ms (of "
            f"{', '.join(f'{s * 1e3:.0f}' for s in own_fp8)})")
    best_floor, best_own = min(floor), min(own + again, default=None)
    print(f"\n{'way':<28} best ms   fill ms   load ms  (copies)  finish ms  control ms  start ms   x floor   "
          "vs vLLM's own")
    print(f"{'floor (flat copy)':<28} {best_floor * 1e3:7.1f}")
    for label, times in (("vLLM's own", own), ("vLLM's own, again", again), ("vLLM's own into FP8", own_fp8)):
        if times:
            print(f"{label:<28} {min(times) * 1e3:7.1f}                                              "
                  f"{min(times) / best_floor:7.1f}x")
    for way, reports in rows.items():
        steady = reports[1:]  # (the first: init, and direct's check against vLLM's loader)
        best = min(steady, key=lambda r: r["timings"]["total"])
        t = best["timings"]
        control = t["load"] - t["load_copy"] + t["finish"]
        theirs = min(own_fp8) if way.startswith("fp8") else best_own  # (vLLM's own into the same engine)
        print(f"wsync {way:<22} {t['total'] * 1e3:7.1f}  {t['fill'] * 1e3:8.1f}  {t['load'] * 1e3:8.1f}  "
              f"{t['load_copy'] * 1e3:8.1f}  {t['finish'] * 1e3:9.1f}  {control * 1e3:10.1f}  "
              f"{t.get('start', 0) * 1e3:8.1f}  "
              f"{t['total'] / best_floor:7.2f}x  {theirs / t['total']:7.1f}x faster")
    if "direct" in rows:
        checked = rows["direct"][0]["timings"]["total"]
        print(f"(wsync direct's first publication, with init and the check against vLLM's loader: {checked * 1e3:.0f} "
              "ms)")
    direct_fp8 = [way for way in ("fp8 direct", "fp8 direct storage") if way in rows]
    if direct_fp8:
        # (The faster of the direct ways into FP8, named.)
        total, way = min((min(r["timings"]["total"] for r in rows[way][1:]), way) for way in direct_fp8)
        print(f"fp8 publish 30B-A3B direct: {total * 1e3:.1f} ms = {total / best_floor:.2f} x the bf16 floor "
              f"({best_floor * 1e3:.1f} ms), {min(own_fp8) / total:.0f} x faster than vLLM's own "
              f"({min(own_fp8) * 1e3:.0f} ms) (wsync {way})")
        for way in direct_fp8:
            checked = rows[way][0]["timings"]["total"]
            print(f"(wsync {way}'s first publication, with init and the check against vLLM's own FP8 loader: "
                  f"{checked * 1e3:.0f} ms)")
    return 0 if len(rows) == len(ways) else 1


if __name__ == "__main__":
    sys.exit(main())
