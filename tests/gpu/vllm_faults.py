"""On the GPU machine, with vLLM: a publication into vLLM that fails is fail-stop. Each case
runs a one-rank trainer (the small Qwen3-MoE of tests/gpu/vllm_e2e.py, one publication) in a
process of its own, with a fault injected into the vllm runtime ($WSYNC_VLLM_FAULT):

- kill_engine@load_chunk#2: vLLM's EngineCore is killed before the second chunk's load
  (named ENGINE_DIED at once, not a timeout: vLLM's own client would wait forever);
- bad_receipt@finish_update: TP rank 0's receipt names another manifest.

Each must end with the trainer's publish raising wsync's error naming the cause, nothing
committed, and then nothing left: no process of the run (marked in its environment) and no
process of it holding GPU memory (nvidia-smi's compute apps).

    python3 tests/gpu/vllm_faults.py
Prints one line per case and "vllm_faults: ok"; exits non-zero on any failure.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from marks import marked_pids  # noqa: E402

TRAINER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    import wsync
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_pretrained("tests/fixtures/models/gpu_tiny")).to("cuda", torch.bfloat16)
    fully_shard(model)
    with wsync.Host("tests/fixtures/recipes/vllm_tiny_cuda.lua") as host:
        agent = host.agent(rank=0, world=1, backend="cuda", device=0)
        agent.register_module(model)
        agent.register_callback("offload_optimizer", lambda: None)
        agent.register_callback("onload_optimizer", lambda: None)
        agent.ready()
        try:
            agent.publish(1)
        except wsync.WsyncError as error:
            print("trainer: publish raised:", error, flush=True)
        else:
            print("trainer: published", flush=True)
""")

CASES = [("kill_engine@load_chunk#2", ("ENGINE_DIED",)),
         ("bad_receipt@finish_update", ("RECEIPT_INVALID",))]


def gpu_pids() -> set[int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout
    return {int(line) for line in out.split() if line.strip().isdigit()}


def main() -> int:
    failures = []
    for fault, says in CASES:
        mark = f"WSYNC_FAULT_MARK={uuid.uuid4().hex}"
        env = dict(os.environ, WSYNC_VLLM_FAULT=fault, WSYNC_FAULT_MARK=mark.split("=", 1)[1])
        seen: set[int] = set()
        process = subprocess.Popen([sys.executable, "-c", TRAINER], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        while process.poll() is None:  # the run's processes, while it runs (short-lived ones too)
            seen.update(marked_pids(mark.encode()))
            time.sleep(0.2)
        output = process.stdout.read()
        time.sleep(2)
        alive = sorted(marked_pids(mark.encode()))
        holding = gpu_pids() & (seen | {process.pid})
        raised = [line for line in output.splitlines() if line.startswith("trainer: publish raised:")]
        named = raised and any(word in raised[0] for word in says)
        print(f"vllm_faults: {fault}: exit {process.returncode}, {len(seen)} processes seen, alive after: {alive}, "
              f"holding GPU memory: {sorted(holding)}; {raised[0] if raised else 'publish did not raise'}", flush=True)
        if not named:
            failures.append(f"{fault}: publish did not raise an error naming {' or '.join(says)}:\n{output[-3000:]}")
        if "trainer: published" in output:
            failures.append(f"{fault}: the publication committed")
        if alive or holding:
            failures.append(f"{fault}: left processes {alive}, GPU memory held by {sorted(holding)}")
    for failure in failures:
        print(f"vllm_faults: FAILED: {failure}", file=sys.stderr)
    if failures:
        return 1
    print("vllm_faults: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
