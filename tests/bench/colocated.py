#!/usr/bin/env python3
"""A model that fits colocated only because of the memory schedule, and the switch's time
against its floor (issue 22, items 4 and 5).

    python3 tests/bench/colocated.py [--steps 10] [--json FILE]          # one H200, vLLM 0.26
    python3 tests/bench/colocated.py --device cpu --steps 2             # any machine: plumbing

On the GPU: tests/fixtures/recipes/colocated_4b.lua, a Qwen3-MoE of 4.4 B parameters. The trainer
is one FSDP2 rank (transformers' model, random init) in mixed precision: bfloat16
parameters, float32 master weights and AdamW moments (MixedAdamW below), 57 GiB; vLLM TP1
reserves 0.85 of the device, 119 GiB: together 1.26 times the device. Before the runtime
starts the trainer makes its optimizer state and moves it to pinned host memory
(wsync.OptimizerOffload(params=True)); the recipe's schedule then gives the device to each
in turn, and each RL step is one publish call that is the whole switch
(``Agent.publish(generate=...)``): offload_optimizer, wake weights, publish, offload_actor,
wake kv_cache, generate (the step's rollouts, with the weights just published), onload_actor
and sleep 2 at once (a together step), onload_optimizer; then the trainer trains on
the rollouts (GRPO as in bindings/python/examples/grpo.py).

Checked: every rollout comes from the version just published; the train/inference
mismatch of the sampled tokens stays at bfloat16's noise (GPU); every schedule step's
device memory is within 5 % or 1 GiB of the model's prediction (the run report's
``predicted_bytes`` beside its NVML sample, GPU); ``wsync check`` refuses the same recipe
without its offload steps, naming the step and the bytes over.

Measured: each step's time beside its floor, the bytes it moved over the bandwidth of the
same direction measured in this run (a flat pinned copy for the trainer's offloads and
onloads, a flat device copy for the publication); vLLM's sleep and wake free and map memory
and have no copy floor (their time is reported apart). The switch to generation
(offload_optimizer to wake kv_cache, the publication included) and back (sleep to
onload_optimizer), steps 2 on (the first allocates the pinned arenas), end with:

    schedule switch: X s = R x its floor (Y s)

On the CPU (tests/fixtures/recipes/colocated_cpu.lua, the reference runtime and a small
model) the same loop runs for its plumbing: no memory is sampled there, nothing is learned.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
if importlib.util.find_spec("wsync") is None:  # (the bundle's package, with libwsync beside it, comes first)
    sys.path.insert(0, str(ROOT / "bindings" / "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

import wsync  # noqa: E402

RECIPES = {"cuda": "tests/fixtures/recipes/colocated_4b.lua", "cpu": "tests/fixtures/recipes/colocated_cpu.lua"}
MODELS = {"cuda": ROOT / "tests" / "fixtures" / "models" / "qwen3_moe_4b",
          "cpu": ROOT / "recipes" / "models" / "qwen3-moe-small"}
#: Steps of a round that are no part of the switch (the waits for the trainer).
WAITS = ("train_step", "publish_wait")
#: Copies to the host and back, by step; the publication is a device copy.
HOST_COPIES = {"offload_optimizer": "to_host", "offload_actor": "to_host", "onload_actor": "to_device",
               "onload_optimizer": "to_device"}
GIB = 1024 ** 3
#: Who copies an onload's bytes (wsync's offloaders' ``onload_copy``).
COPIERS = {"kernel": "a kernel", "engine": "the copy engine", "host": "the host"}


def grpo() -> Any:
    """bindings/python/examples/grpo.py, for its rewards, advantages and training step."""
    spec = importlib.util.spec_from_file_location("grpo", ROOT / "bindings" / "python" / "examples" / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class MixedAdamW:
    """AdamW in mixed precision over this rank's FSDP2 shards: the model keeps its bfloat16
    parameters (what the forward pass and the publication read); the optimizer steps float32
    master copies with float32 moments, made at once (``materialize``) so that they can be
    moved to the host before the runtime starts. ``inner`` is the torch optimizer, whose
    parameters are the masters (wsync.OptimizerOffload(inner, params=True) moves them)."""

    def __init__(self, parameters: Any, lr: float) -> None:
        self.pairs = []
        for parameter in parameters:
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
            self.pairs.append((parameter, torch.nn.Parameter(local.detach().float().clone())))
        self.inner = torch.optim.AdamW([master for _, master in self.pairs], lr=lr)

    def materialize(self) -> None:
        """AdamW's state, as its first step makes it (zero moments), made now."""
        for _, master in self.pairs:
            self.inner.state[master] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(master),
                                        "exp_avg_sq": torch.zeros_like(master)}

    def step(self) -> None:
        for parameter, master in self.pairs:
            grad = parameter.grad
            if grad is not None:
                master.grad = (grad.to_local() if hasattr(grad, "to_local") else grad).float()
        self.inner.step()
        with torch.no_grad():
            for parameter, master in self.pairs:
                (parameter.to_local() if hasattr(parameter, "to_local") else parameter).copy_(master)
                master.grad = None

    def zero_grad(self) -> None:
        for parameter, _ in self.pairs:
            parameter.grad = None


def bandwidths(device: str, gib: float = 2.0) -> dict[str, float]:
    """Bytes per second of one flat copy of `gib` GiB: to pinned host memory and back, and
    within the device (read and write counted once, as a publication's bytes are). Empty
    on the CPU."""
    if device != "cuda":
        return {}
    size = int(gib * GIB)
    source = torch.empty(size, dtype=torch.uint8, device="cuda")
    target = torch.empty(size, dtype=torch.uint8, device="cuda")
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    figures = {}
    for name, copy in (("to_host", lambda: host.copy_(source, non_blocking=True)),
                       ("to_device", lambda: source.copy_(host, non_blocking=True)),
                       ("device", lambda: target.copy_(source, non_blocking=True))):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            copy()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        figures[name] = size / best
    del source, target, host
    torch.cuda.empty_cache()
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None)  # (torch keeps freed pinned blocks)
    if empty_host_cache is not None:
        empty_host_cache()
    return figures


def refused_without_offloads(recipe: str) -> str:
    """`wsync check --plan-only` of `recipe` with its offload and onload steps left out:
    its refusal (stderr), which must name the step and the bytes over."""
    schedule = ('schedule={ { wake = { "weights" } }, "publish", { wake = { "kv_cache" } }, "generate", '
                '{ sleep = 2 } }')
    program = os.environ.get("WSYNC_BIN") or "wsync"
    result = subprocess.run([program, "check", "--plan-only", recipe, schedule], capture_output=True, text=True,
                            cwd=ROOT, check=False)
    if result.returncode == 0:
        raise AssertionError(f"wsync check accepted {recipe} without its offload steps:\n{result.stdout}")
    return result.stderr.strip()


def step_entries(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A round's steps by name (the last of a name)."""
    return {step["name"]: step for step in report.get("steps", [])}


def memory_off(step: dict[str, Any]) -> tuple[float, float, float] | None:
    """(measured GiB of the most loaded device, predicted GiB, how far outside the model's
    promise: over 1 is outside 5 % or 1 GiB), or None where the step was not sampled."""
    sample, predicted = step.get("device_memory"), step.get("predicted_bytes")
    if not sample or predicted is None:
        return None
    measured = max(entry["used_bytes"] for entry in sample)
    return measured / GIB, predicted / GIB, abs(measured - predicted) / max(0.05 * predicted, GIB)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="RL steps (default 10)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (default 4)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per completion (default 32)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    os.chdir(ROOT)
    device, recipe = args.device, RECIPES[args.device]
    examples = grpo()

    refusal = refused_without_offloads(recipe)
    print(f"colocated: without its offload steps wsync check refuses {recipe}: {refusal}", flush=True)

    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    config = Qwen3MoeConfig.from_pretrained(str(MODELS[device]))
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):  # (made where it lives: 4.4 B parameters do not go through the host)
        model = Qwen3MoeForCausalLM(config)
    torch.set_default_dtype(default_dtype)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = MixedAdamW(model.parameters(), args.lr)
    optimizer.materialize()
    # (Onloads by a kernel: they follow vLLM's sleep, after which the copy engine copies to
    # the device at half speed for 100-250 ms, tests/bench/host_pinned.py.)
    state = wsync.OptimizerOffload(optimizer.inner, params=True, onload_copy="kernel")
    actor = wsync.ActorOffload(model, onload_copy="kernel")
    floors = bandwidths(device)
    started = time.perf_counter()
    moved = state.offload()  # (before the runtime starts: vLLM takes its share of the device at its start)
    offloaded = time.perf_counter()
    reserved = actor.reserve()  # (its arena too, before vLLM's processes take host memory)
    print(f"colocated: {recipe}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters; the optimizer "
          f"state ({moved / GIB:.2f} GiB, masters and moments) moved to the host in "
          f"{offloaded - started:.2f} s and the actor's arena ({reserved / GIB:.2f} GiB) page-locked in "
          f"{time.perf_counter() - offloaded:.2f} s, before the runtime starts", flush=True)
    if floors:
        print("colocated: flat copies in this run: " + ", ".join(f"{name} {value / 1e9:.1f} GB/s"
                                                                   for name, value in floors.items()), flush=True)

    moves: dict[str, list[dict[str, Any]]] = {}  # (each offload's and onload's own account, by step)

    after: dict[str, Any] = {"account": None}  # (the account whose callback's refresh comes next)

    def recorded(offloader: Any, move: Callable[[], int]) -> Callable[[], int]:
        def call() -> int:
            entered = time.monotonic()  # (the clock of the report's `started`)
            moved = move()
            account = dict(offloader.last)
            started = time.perf_counter()
            if device == "cuda":
                torch.cuda.synchronize()  # (the copies an onload queued; the agent's own wait is then none)
            account["wait_seconds"] = time.perf_counter() - started
            account["refresh_seconds"] = 0.0
            account["entered"], account["synchronized"] = entered, time.monotonic()
            after["account"] = account
            moves.setdefault(offloader.last["step"], []).append(account)
            return moved
        return call

    def offload_optimizer() -> int:
        # (round 1: still on the host since the start)
        return 0 if state.offloaded else recorded(state, state.offload)()

    below = config.vocab_size // 8
    generator = torch.Generator().manual_seed(0)
    rows, failures = [], []
    with wsync.Host(recipe, trainer__steps=args.steps + 1) as host:
        agent = host.agent(rank=0, world=1, backend="cuda" if device == "cuda" else "host", device=0)
        agent.register_module(model)
        refresh = agent._refresh  # (timed: what the agent does after a callback beside waiting for it)

        def timed_refresh(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return refresh(*args, **kwargs)
            finally:
                if after["account"] is not None:  # (the agent's first look after a callback)
                    after["account"]["refresh_seconds"] = time.perf_counter() - started
                    after["account"] = None
        agent._refresh = timed_refresh
        agent.register_callback("offload_optimizer", offload_optimizer)
        agent.register_callback("onload_optimizer", recorded(state, state.onload))
        agent.register_callback("offload_actor", recorded(actor, actor.offload))
        agent.register_callback("onload_actor", recorded(actor, actor.onload))
        agent.ready()
        for step in range(args.steps + 1):
            prompts = torch.randint(0, config.vocab_size, (args.prompts, 8), generator=generator).tolist()
            requests = [prompt for prompt in prompts for _ in range(args.group)]
            started = time.perf_counter()
            publication = agent.publish(step, generate={"prompts": requests, "sampling": {
                "max_tokens": args.max_tokens, "temperature": 1.0, "ignore_eos": True}})
            call = time.perf_counter() - started
            outputs = publication.generation["outputs"]
            versions = sorted({output["model_version"] for output in outputs})
            if versions != [publication.model_version]:
                failures.append(f"step {step}: rollouts of versions {versions}, published {publication.model_version}")
            steps = step_entries(publication.report)
            host_steps = {}  # (each trainer step as the host timed it, a together step's part too)
            for entry in publication.report.get("steps", []):
                for part in entry.get("parts") or [entry]:
                    host_steps[part["name"]] = part
            for name, accounts in moves.items():
                timed = host_steps.get(name)
                account = accounts[-1] if accounts else None
                if account and "host_seconds" not in account and timed and "started" in timed:
                    # (From the host's start of the step to the callback, and from the copies' end
                    # to the host's end of it: the agent's round trip and look at its tensors.)
                    account["host_seconds"] = timed["seconds"]
                    account["before_seconds"] = account["entered"] - timed["started"]
                    account["after_seconds"] = timed["started"] + timed["seconds"] - account["synchronized"]
                    print(f"colocated: step {step}: {name}: the host's {account['host_seconds'] * 1e3:.0f} ms = to "
                          f"the callback {account['before_seconds'] * 1e3:.0f} + in it {account['seconds'] * 1e3:.0f} "
                          f"+ its copies {account['wait_seconds'] * 1e3:.0f} + to the host "
                          f"{account['after_seconds'] * 1e3:.0f} (of which the agent's look "
                          f"{account['refresh_seconds'] * 1e3:.0f})", flush=True)
            row = {"step": step, "version": publication.model_version, "call": call,
                   "publication": publication.seconds,
                   "steps": {name: {"seconds": entry["seconds"], "bytes": entry.get("bytes"),
                                    "parts": entry.get("parts"), "memory": memory_off(entry)}
                             for name, entry in steps.items()},
                   "order": [entry["name"] for entry in publication.report.get("steps", [])]}
            if step < args.steps:
                rewards = examples.rewards_of(outputs, below)
                started = time.perf_counter()
                mismatch, worst = examples.train_step(model, optimizer, requests, outputs,
                                                      examples.advantages_of(rewards, args.group), device)
                row.update(train=time.perf_counter() - started, reward=statistics.fmean(rewards), mismatch=mismatch,
                           mismatch_max=worst)
            rows.append(row)
            generate = steps.get("generate", {}).get("seconds", 0.0)
            memory = [entry["memory"] for entry in row["steps"].values() if entry["memory"]]
            worst_memory = max(memory, key=lambda off: off[2]) if memory else None
            print(f"colocated: step {step}/{args.steps}: version {publication.model_version}, publish call "
                  f"{call:.2f} s (publication {publication.seconds * 1e3:.1f} ms, generate {generate:.2f} s)"
                  + (f", train {row['train']:.2f} s, reward {row['reward']:.3f}, mismatch {row['mismatch']:.4f} nat"
                     if "train" in row else "")
                  + (f"; memory furthest from the model: measured {worst_memory[0]:.2f} GiB, predicted "
                     f"{worst_memory[1]:.2f} ({worst_memory[2]:.2f} of its tolerance)" if worst_memory else ""),
                  flush=True)
    dist.destroy_process_group()

    # The memory model's promise, over every sampled step of every round.
    sampled = [(row["step"], name, entry["memory"]) for row in rows for name, entry in row["steps"].items()
               if entry["memory"]]
    if sampled:
        step, name, (measured, predicted, ratio) = max(sampled, key=lambda item: item[2][2])
        print(f"colocated: memory: worst step {name} (RL step {step}): predicted {predicted:.2f} GiB, measured "
              f"{measured:.2f} GiB, {ratio:.2f} of the tolerance (5 % or 1 GiB)", flush=True)
        if ratio > 1:
            failures.append(f"step {name} of RL step {step}: measured {measured:.2f} GiB, predicted {predicted:.2f}")
    elif device == "cuda":
        failures.append("no step's device memory was sampled")

    # The switch against its floor, steps 2 on: the steps before "generate" and after it,
    # in the round's order; a together step's two parts run at once, so its floor is the
    # larger of theirs.
    summary: dict[str, Any] = {"rows": rows, "bandwidths": floors}
    if floors and len(rows) > 2:
        def floor_of(name: str, moved: float) -> float:
            if name in HOST_COPIES:
                return moved / floors[HOST_COPIES[name]]
            if name == "publish":
                return moved / floors["device"]
            return 0.0  # (vLLM's sleep and wake map and free memory: no copy floor)

        def median_step(name: str) -> tuple[float, float, list[tuple[str, float, float]]]:
            entries = [row["steps"][name] for row in rows[2:] if name in row["steps"]]
            seconds = statistics.median(entry["seconds"] for entry in entries)
            parts = []
            for index, part in enumerate(entries[0].get("parts") or []):
                part_seconds = statistics.median(entry["parts"][index]["seconds"] for entry in entries)
                part_bytes = statistics.median((entry["parts"][index].get("bytes") or 0) for entry in entries)
                parts.append((part["name"], part_seconds, floor_of(part["name"], part_bytes)))
            if parts:
                return seconds, max(floor for _, _, floor in parts), parts
            moved = statistics.median((entry["bytes"] or 0) for entry in entries)
            return seconds, floor_of(name, moved), []

        order = [name for name in rows[-1]["order"] if name not in WAITS]
        split = order.index("generate")
        total, floor_total = 0.0, 0.0
        for direction, names in (("to generation", order[:split]), ("to training", order[split + 1:])):
            described = []
            for name in names:
                seconds, floor, parts = median_step(name)
                total, floor_total = total + seconds, floor_total + floor
                text = f"{name} {seconds * 1e3:.0f} ms" + (f" (floor {floor * 1e3:.0f} ms, {seconds / floor:.2f} x)"
                                                            if floor else "")
                if parts:
                    text += " [at once: " + ", ".join(f"{part} {part_seconds * 1e3:.0f} ms" + (
                        f" (floor {part_floor * 1e3:.0f} ms, {part_seconds / part_floor:.2f} x)" if part_floor else "")
                        for part, part_seconds, part_floor in parts) + "]"
                described.append(text)
            print(f"colocated: switch {direction}: " + ", ".join(described), flush=True)
        ratio = total / floor_total if floor_total else float("inf")
        print(f"schedule switch: {total:.2f} s = {ratio:.2f} x its floor ({floor_total:.2f} s)", flush=True)
        summary["switch"] = {"seconds": total, "floor": floor_total, "ratio": ratio}
    # Where an offloader's time goes beside its copies (its own clock; `recorded` waits for
    # the copies an onload queued, so the agent's own wait after it is none).
    for name, accounts in sorted(moves.items()):
        later = accounts[1:] or accounts
        own = {key: statistics.median(account.get(key, 0.0) for account in later)
               for key in ("seconds", "allocate_seconds", "free_seconds", "wait_seconds", "refresh_seconds",
                           "host_seconds", "before_seconds", "after_seconds")}
        print(f"colocated: {name} inside its callback: {own['seconds'] * 1e3:.0f} ms, of which "
              + (f"allocating the storages {own['allocate_seconds'] * 1e3:.0f} ms" if "onload" in name else
                 f"freeing them (and emptying the cache) {own['free_seconds'] * 1e3:.0f} ms")
              + f" ({later[0]['storages']} storages"
              + (f", copied by {COPIERS[later[0]['copy']]}" if "copy" in later[0] else "")
              + f"); then waiting for its copies {own['wait_seconds'] * 1e3:.0f} ms, "
              f"the agent's look at its tensors {own['refresh_seconds'] * 1e3:.0f} ms; the host's step "
              f"{own['host_seconds'] * 1e3:.0f} ms, from its start to the callback {own['before_seconds'] * 1e3:.0f} "
              f"ms, from the copies' end to its end {own['after_seconds'] * 1e3:.0f} ms", flush=True)
    summary["moves"] = moves
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, default=str))
    for failure in failures:
        print(f"colocated: FAILED: {failure}", file=sys.stderr)
    if failures:
        return 1
    print(f"colocated: ok ({args.steps} RL steps, every rollout of the version just published)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
