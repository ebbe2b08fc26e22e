"""The RL step's publication (issue 20): generation and publication interleaved as an RL loop
runs them, into real vLLM, for three model sizes, each against its flat-copy floor measured in
the same run.

On the GPU machine with the vLLM bundle (`. .vllm/activate.sh`) and the wsync bundle's
environment (`. build/bundle/env.sh`):

    python3 tests/bench/rl_step.py [--models tiny,1.5GB,30B-A3B] [--steps 50] [--json FILE]

A model named MODEL+rpc runs with the recipe's ``runtime.channel = "rpc"`` (the weight commands
through vLLM's collective_rpc rather than wsync's socket to each TP worker, the default).

Per model (tests/fixtures/recipes/rl_step_*.lua): one trainer rank embedding wsync
(wsync.Host) whose tensors are views of one bfloat16 allocation, random values; vLLM TP1 on
the same GPU, dummy weights, the direct loader from the trainer's own storage (one chunk). The
first publication maps, plans and checks the loader against vLLM's own (reported apart); then
STEPS times: a rollout through ``Host.generate`` (PROMPTS sampled completions of TOKENS
tokens, temperature 1; TOKENS by model below), then a publication. A publication's wall time
is ``agent.publish``'s, in this process; its phases are the session's own report: start (the
header to every worker), fill, load (of which copies: the TP worker's copy), finish (of which
commit: the runtime's commit of the version, its prefix cache), control (everything that is
not the copy). The floor: one flat device copy of the model's bytes (torch's ``copy_``),
median of 20.

With --vllm-own (default: the first model), vLLM's own ``LLM.generate`` runs the same batch
on an engine of the same arguments in this process, alive beside the runtime's for that
model's whole run: at every step its rollout runs just before the one through wsync, so the
two alternate on the same GPU and the same host load (an eager engine's speed moves from one
start to the next and with the machine's load; one engine timed after the other is no
comparison). Each rollout through wsync also says how long vLLM's LLM.generate took inside
the runtime, so the rest is wsync's own path. That engine's ``reset_prefix_cache`` is timed
too (what each commit paid before wsync salted its requests by version). With --control, a
second engine of vLLM's own alternates as well: how far two engines of the same arguments
differ in one run, beside how far the one through wsync differs.

Ends with one line per model:
    rl step publish: MODEL: median X ms over N (floor Y ms, Z x), engine live
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"tiny": "tests/fixtures/recipes/rl_step_tiny.lua",
          "1.5GB": "tests/fixtures/recipes/rl_step_1p5g.lua",
          "30B-A3B": "tests/fixtures/recipes/rl_step_30b.lua"}
#: Tokens per completion unless --tokens says: 32 as the RL example's rollouts
#: (bindings/python/examples/grpo.py: 64 completions of 32 tokens after 8-token prompts);
#: the 30B-A3B's eager decode step takes about 100 ms on the H200, so its rollouts are
#: shorter (the engine is as live: the same requests through the same scheduler and KV
#: cache).
TOKENS = {"tiny": 32, "1.5GB": 32, "30B-A3B": 4}
PHASES = ("start", "fill", "load", "load_copy", "finish", "commit")


def say(text: str) -> None:
    print(f"rl_step: {text}", flush=True)


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


def engine_arguments(wsync, recipe: str) -> tuple[str, dict]:
    """The recipe's vLLM model directory and engine arguments, as the vllm runtime gets them."""
    with wsync.Host() as host:
        found = host.call("recipe", recipe=recipe)
    return found["model_dir"], found["runtime"]["vllm"]


def prompts_for(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    import torch
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=generator).tolist()


def flat_copy_floor(torch, storage, repeats: int = 20) -> float:
    target = torch.empty_like(storage)
    seconds = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(storage)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    del target
    torch.cuda.empty_cache()
    return statistics.median(seconds[1:])


def recipe_of(name: str) -> tuple[str, dict]:
    """A model's recipe and overrides (MODEL+rpc, MODEL+socket: that channel)."""
    model, _, way = name.partition("+")
    return MODELS[model], ({"runtime.channel": way} if way else {})


def with_steps(overrides: dict, steps: int) -> dict:
    """``overrides`` and the session's publications: the first and ``steps`` more."""
    return dict(overrides, **{"trainer.steps": steps + 1})


def run_model(wsync, torch, name: str, recipe: str, args, overrides: dict, owns: "list[Own] | None" = None) -> dict:
    from vllm_publish import trainer_storage  # (this directory: the same trainer storage)
    storage, tensors = trainer_storage(wsync, recipe)
    nbytes, count = storage.numel() * 2, len(tensors)
    floor = flat_copy_floor(torch, storage)
    say(f"{name}: {count} trainer tensors, {nbytes / 1e9:.3f} GB; floor (one flat copy) {floor * 1e3:.3f} ms")
    model_dir, _ = engine_arguments(wsync, recipe)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prompts = prompts_for(vocab, args.prompts, args.prompt_tokens, seed=1)
    max_tokens = args.tokens or TOKENS[name.partition("+")[0]]
    walls, phases, generation, engine, tokens, stale = [], {phase: [] for phase in PHASES}, [], [], [], []
    with wsync.Host(recipe, **with_steps(overrides, args.steps)) as host:
        agent = host.agent(rank=0, world=1, backend="cuda", device=0)
        for tensor_name, tensor in tensors.items():
            agent.register_tensor(tensor_name, tensor)
        agent.ready()
        torch.cuda.synchronize()
        started = time.perf_counter()
        agent.publish(1)
        first_seconds = time.perf_counter() - started
        say(f"{name}: first publication (init, plan, the check against vLLM's own loader) {first_seconds * 1e3:.0f} "
            "ms")
        for step in range(2, args.steps + 2):
            for own in owns or ():
                own.rollout()
            started = time.perf_counter()
            result = host.generate(prompts, max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
            seconds = time.perf_counter() - started
            produced = sum(len(output["token_ids"]) for output in result["outputs"])
            generation.append(seconds)
            engine.append(float(result.get("engine_seconds", float("nan"))))
            tokens.append(produced)
            wrong = [output["model_version"] for output in result["outputs"] if output["model_version"] != step - 1]
            if wrong or result["model_version"] != step - 1:
                stale.append(f"step {step}: generation stamped {sorted(set(wrong))}, expected {step - 1}")
            # (The trainer's step: its weights change in place.)
            storage.add_(1e-4)
            torch.cuda.synchronize()
            started = time.perf_counter()
            publication = agent.publish(step)
            walls.append(time.perf_counter() - started)
            if publication.model_version != step:
                stale.append(f"step {step}: published version {publication.model_version}")
            for phase in PHASES:
                value = publication.timings.get(phase)
                if value is not None:
                    phases[phase].append(float(value))
            phases.setdefault("total", []).append(float(publication.timings["total"]))
            if args.verbose:
                t = publication.timings
                say(f"{name} step {step}: publish {walls[-1] * 1e3:.2f} ms (session {t['total'] * 1e3:.2f}: start "
                    f"{t['start'] * 1e3:.2f}, load {t['load'] * 1e3:.2f}, finish {t['finish'] * 1e3:.2f}); "
                    f"generate {seconds * 1e3:.1f} ms, {produced} tokens")
        # (What the runtime says of its own command times: its closing line in the log.)
        info = host.runtime_info()
    del tensors, storage
    gc.collect()
    torch.cuda.empty_cache()
    control = [total - copy for total, copy in zip(phases["total"], phases["load_copy"])]
    row = {
        "model": name, "bytes": nbytes, "tensors": count, "steps": len(walls), "tokens": max_tokens,
        "floor_ms": floor * 1e3, "median_ms": median_ms(walls), "best_ms": min(walls) * 1e3,
        "p90_ms": statistics.quantiles(walls, n=10)[-1] * 1e3 if len(walls) >= 10 else None,
        "session_median_ms": median_ms(phases["total"]),
        "phases_median_ms": {phase: median_ms(values) for phase, values in phases.items() if values},
        "control_median_ms": median_ms(control),
        "first_ms": first_seconds * 1e3,
        "generate_median_ms": median_ms(generation),
        # (vLLM's LLM.generate inside the runtime: the rest of generate_median_ms is wsync's path)
        "generate_engine_median_ms": median_ms(engine),
        "generate_tokens_per_s": statistics.median(n / s for n, s in zip(tokens, generation)),
        "prefix_cache_resets": info.get("prefix_cache_resets"),
        "stale": stale,
    }
    row["ratio"] = row["median_ms"] / row["floor_ms"]
    return row


class Own:
    """vLLM's own LLM.generate on a model's batch: an engine of the recipe's arguments in this
    process (as the vllm runtime makes its own), and its ``reset_prefix_cache`` after each
    rollout."""

    def __init__(self, torch, wsync, name: str, recipe: str, args) -> None:
        from vllm import LLM, SamplingParams, TokensPrompt
        self.torch = torch
        model_dir, engine = engine_arguments(wsync, recipe)
        engine = dict(engine)
        engine.setdefault("logprobs_mode", "processed_logprobs")  # (as the vllm runtime sets it)
        self.llm = LLM(model=model_dir, enable_sleep_mode=True, **engine)
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        self.prompts = [TokensPrompt(prompt_token_ids=p)
                        for p in prompts_for(vocab, args.prompts, args.prompt_tokens, 1)]
        self.params = SamplingParams(max_tokens=args.tokens or TOKENS[name], temperature=1.0, ignore_eos=True,
                                     logprobs=0)
        self.llm.generate(self.prompts, self.params, use_tqdm=False)  # (its first, warming)
        self.rates: list[float] = []
        self.resets: list[float] = []

    def rollout(self) -> None:
        started = time.perf_counter()
        outputs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        seconds = time.perf_counter() - started
        self.rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
        started = time.perf_counter()
        self.llm.reset_prefix_cache()
        self.resets.append(time.perf_counter() - started)

    def close(self) -> dict:
        from wsync.vllm.compat import shutdown_engine_core
        shutdown_engine_core(self.llm)
        del self.llm
        gc.collect()
        self.torch.cuda.empty_cache()
        return {"tokens_per_s": statistics.median(self.rates) if self.rates else float("nan"),
                "rollouts": len(self.rates), "reset_prefix_cache_ms": median_ms(self.resets)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)} (default all)")
    parser.add_argument("--steps", type=int, default=50, help="publications timed per model (default 50)")
    parser.add_argument("--prompts", type=int, default=64, help="completions per rollout (default 64)")
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"tokens per completion (default {', '.join(f'{m} {n}' for m, n in TOKENS.items())})")
    parser.add_argument("--prompt-tokens", type=int, default=8, help="tokens per prompt (default 8)")
    parser.add_argument("--vllm-own", default=None,
                        help="the model whose batch vLLM's own LLM.generate also runs (default: the first; 'none')")
    parser.add_argument("--control", action="store_true",
                        help="a second engine of vLLM's own alternates too: how far two engines of the same "
                             "arguments differ in one run")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--verbose", action="store_true", help="a line per publication")
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = sorted(name for name in models if name.partition("+")[0] not in MODELS
                     or name.partition("+")[2] not in ("", "rpc", "socket"))
    if unknown:
        parser.error(f"unknown models {unknown} (known: {', '.join(MODELS)})")
    own_model = args.vllm_own or models[0]
    os.chdir(ROOT)
    import torch

    import wsync
    torch.cuda.set_device(0)
    say(f"{torch.cuda.get_device_name()}; {args.steps} steps per model, each a rollout of {args.prompts} "
        "completions then a publication")
    rows, failures, owns = [], [], []
    for name in models:
        engines: list[Own] = []
        try:
            recipe, overrides = recipe_of(name)
            if name == own_model:
                try:
                    for _ in range(2 if args.control else 1):
                        engines.append(Own(torch, wsync, name.partition("+")[0], recipe, args))
                except Exception as error:  # (reported; the rest still runs)
                    failures.append(f"vLLM's own generate: {type(error).__name__}: {error}")
            rows.append(run_model(wsync, torch, name, recipe, args, overrides, engines))
        except Exception as error:  # (reported; the other models still run)
            failures.append(f"{name}: {type(error).__name__}: {error}")
            say(f"{name}: FAILED: {type(error).__name__}: {error}")
            continue
        finally:
            owns.extend(engine.close() for engine in engines)
        if rows[-1]["stale"]:
            failures.extend(f"{name}: {what}" for what in rows[-1]["stale"])
    print(f"\n{'model':<13} {'GB':>7} {'floor ms':>9} {'median ms':>10} {'p90 ms':>8} {'x floor':>8} "
          f"{'start':>6} {'fill':>6} {'load':>6} {'(copy)':>7} {'finish':>7} {'(commit)':>9} {'control':>8} "
          f"{'gen ms':>7} {'tok/s':>8}")
    for row in rows:
        p = row["phases_median_ms"]
        print(f"{row['model']:<13} {row['bytes'] / 1e9:7.3f} {row['floor_ms']:9.3f} {row['median_ms']:10.2f} "
              f"{(row['p90_ms'] or float('nan')):8.2f} {row['ratio']:8.2f} {p.get('start', 0):6.2f} "
              f"{p.get('fill', 0):6.2f} {p.get('load', 0):6.2f} {p.get('load_copy', 0):7.2f} {p.get('finish', 0):7.2f} "
              f"{p.get('commit', float('nan')):9.3f} {row['control_median_ms']:8.2f} {row['generate_median_ms']:7.1f} "
              f"{row['generate_tokens_per_s']:8.0f}")
    ours = next((row for row in rows if row["model"] == own_model), None)
    if owns and ours is not None and owns[0]["rollouts"]:
        theirs = owns[0]
        overhead = theirs["tokens_per_s"] / ours["generate_tokens_per_s"] - 1
        path = ours["generate_median_ms"] - ours["generate_engine_median_ms"]
        print(f"a rollout through wsync: median {ours['generate_median_ms']:.1f} ms, of which vLLM's LLM.generate in "
              f"the runtime {ours['generate_engine_median_ms']:.1f} ms (wsync's path {path:.1f} ms); vLLM's "
              f"reset_prefix_cache on the own engine: {theirs['reset_prefix_cache_ms']:.2f} ms")
        print(f"rl step generate: {own_model}: {ours['generate_tokens_per_s']:.0f} tokens/s through wsync, "
              f"{theirs['tokens_per_s']:.0f} tokens/s vLLM's own LLM.generate, alternating over {theirs['rollouts']} "
              f"rollouts of {args.prompts} x {args.tokens or TOKENS[own_model.partition('+')[0]]} tokens "
              f"({overhead * 100:+.1f} % time through wsync)")
        if len(owns) > 1 and owns[1]["rollouts"]:
            spread = owns[0]["tokens_per_s"] / owns[1]["tokens_per_s"] - 1
            print(f"rl step generate: {own_model}: a second engine of vLLM's own, the same arguments, alternating too: "
                  f"{owns[1]['tokens_per_s']:.0f} tokens/s ({spread * 100:+.1f} % time in it against the first: "
                  "what one engine differs from another)")
    for row in rows:
        print(f"rl step publish: {row['model']}: median {row['median_ms']:.2f} ms over {row['steps']} (floor "
              f"{row['floor_ms']:.3f} ms, {row['ratio']:.2f} x), engine live")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "vllm_own": owns, "failures": failures}, indent=1))
    for failure in failures:
        print(f"rl_step: FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
