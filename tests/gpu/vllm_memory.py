"""On the GPU machine, with vLLM (the bundle's activate.sh): what vLLM holds on the device in
each state the memory schedule moves it through, measured, beside what vLLM says it
reserved. The data the memory model of issue 22 is calibrated from.

    python3 tests/gpu/vllm_memory.py MODEL_DIR [--utilization U] [--max-model-len N] [--json FILE]

Starts vLLM (TP1, dummy weights, sleep mode, eager) on GPU 0 and records, per GPU process
(NVML through nvidia-smi, as wsync's run report samples it), the memory in use: after
start, after a generation, after sleep(level=1), after wake(weights), after wake(kv_cache),
after sleep(level=2), after wake of both. Prints one line per state and, from vLLM's log,
its own account of the reservation (weights, activation peak, non-torch, KV cache).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def gpu_processes() -> dict[int, int]:
    """Bytes in use on the device per process id (nvidia-smi's compute apps)."""
    text = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, check=True).stdout
    used = {}
    for line in text.strip().splitlines():
        pid, mib = (part.strip() for part in line.split(","))
        used[int(pid)] = int(mib) << 20
    return used


def device_used() -> tuple[int, int]:
    """(bytes in use, total bytes) on device 0."""
    text = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=memory.used,memory.total",
                           "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True).stdout
    used, total = (int(part.strip()) << 20 for part in text.strip().split(","))
    return used, total


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--utilization", type=float, default=0.3)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--json")
    options = parser.parse_args()
    from vllm import LLM, SamplingParams

    baseline, total = device_used()
    llm = LLM(model=options.model, load_format="dummy", enforce_eager=True, skip_tokenizer_init=True, seed=0,
              gpu_memory_utilization=options.utilization, max_model_len=options.max_model_len,
              enable_sleep_mode=True, tensor_parallel_size=1)
    rows = []

    def record(state: str) -> None:
        time.sleep(0.5)  # (NVML's per-process figure lags a freed allocation a little)
        used, _ = device_used()
        processes = gpu_processes()
        rows.append({"state": state, "device_used": used - baseline, "processes": processes})
        listed = ", ".join(f"pid {pid} {value / 2**30:.3f} GiB" for pid, value in sorted(processes.items()))
        print(f"vllm_memory: {state:<22} device {(used - baseline) / 2**30:8.3f} GiB over the baseline; {listed}",
              flush=True)

    prompts = [{"prompt_token_ids": list(range(1, 33))} for _ in range(64)]
    params = SamplingParams(max_tokens=32, temperature=1.0)
    record("started")
    llm.generate(prompts, params, use_tqdm=False)
    record("generated")
    llm.sleep(level=1)
    record("sleep 1")
    llm.wake_up(tags=["weights"])
    record("wake weights")
    llm.wake_up(tags=["kv_cache"])
    record("wake kv_cache")
    llm.generate(prompts, params, use_tqdm=False)
    record("generated again")
    llm.sleep(level=2)
    record("sleep 2")
    llm.wake_up()
    record("wake all")
    summary = {"model": options.model, "utilization": options.utilization, "total": total,
               "requested": int(options.utilization * total), "rows": rows}
    print("vllm_memory: " + json.dumps({"utilization": options.utilization, "total": total,
                                        "requested": summary["requested"]}), flush=True)
    if options.json:
        with open(options.json, "w") as out:
            json.dump(summary, out, indent=1)
    del llm
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    sys.exit(main())
