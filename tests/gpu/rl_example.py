"""On the GPU machine, with vLLM (the bundle's activate.sh): the RL example
(bindings/python/examples/grpo.py, recipes/grpo_tiny.lua) for 50 steps, its output passed
through, then checked:

- It exits 0 and prints every step and the summary line, which agree.
- The reward rises: the mean of the last 10 steps is at least REWARD_RISE above the mean of
  the first 10. A random policy scores 1/8 (the fraction of tokens below vocab_size / 8).
  Each step averages 64 completions of 32 tokens; for a policy that does not learn, the
  difference of two means of 10 steps has a standard deviation of 0.003 (independent
  tokens) to 0.018 (were each completion's 32 tokens one draw: sqrt(2 x 0.11 / 640)).
  0.25 is 13 times the larger, and under a third of what the same loop gained on the CPU
  sampling from the trainer's own model (0.13 to 0.98-1.0 by step 35; two seeds, lr 2e-3).
- The mismatch stays at bfloat16's rounding: every step's mean |trainer's log-probability -
  vLLM's| over the sampled tokens is at most MISMATCH nat. tests/gpu/vllm_e2e.py measured
  0.021-0.034 nat between the trainer and vLLM on the same weights with logits made far
  larger than these (embeddings and head x40); on the CPU, two forward passes of the same
  weights by different paths (incremental with a KV cache, and whole) differed by 0.001
  nat on the mean and under 0.17 on any token. A wrong weight, or a generation from other
  weights than the trainer's, is nats away (vLLM's dummy weights against the trainer's:
  38 nat).
- Every step generated with the version published just before it, and published the next.

    python3 tests/gpu/rl_example.py OUT_DIR
writes OUT_DIR/rl_example.png when matplotlib is there (it says so when not). Prints
"rl_example: ok (...)"; exits non-zero on any failure.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS, WINDOW = 50, 10
REWARD_RISE, MISMATCH = 0.25, 0.05
NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
STEP = re.compile(rf"^rl example: step (\d+)/\d+: reward {NUMBER}, mismatch {NUMBER} nat \(max {NUMBER}\), "
                  rf"version (\d+), .* -> version (\d+)$", re.MULTILINE)
INITIAL = re.compile(r"^rl example: initial weights published as version (\d+) ", re.MULTILINE)
SUMMARY = re.compile(rf"^rl example: reward {NUMBER} -> {NUMBER} over (\d+) steps, mismatch max {NUMBER} nat, "
                     rf"publish median {NUMBER} ms$", re.MULTILINE)


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(ROOT / "bindings" / "python" / "examples" / "grpo.py"), "--steps", str(STEPS)]
    if importlib.util.find_spec("matplotlib") is not None:
        command += ["--plot", str(out / "rl_example.png")]
    else:
        print("rl_example: matplotlib is not installed here: no plot", flush=True)
    lines = []
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          stdin=subprocess.DEVNULL) as example:
        for line in example.stdout:
            sys.stdout.write(line)
            lines.append(line)
    text = "".join(lines)
    failures = []
    if example.returncode != 0:
        failures.append(f"the example exited {example.returncode}")

    steps = [(int(step), float(reward), float(mismatch), int(generated), int(published))
             for step, reward, mismatch, _, generated, published in STEP.findall(text)]
    summary = SUMMARY.search(text)
    initial = INITIAL.search(text)
    if [step[0] for step in steps] != list(range(1, STEPS + 1)) or not summary or not initial:
        failures.append(f"{len(steps)} step lines of {STEPS}, summary {'found' if summary else 'missing'}, initial "
                        f"publication {'found' if initial else 'missing'}")
    else:
        rewards = [step[1] for step in steps]
        first, last = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
        if last - first < REWARD_RISE:
            failures.append(f"the reward rose from {first:.3f} to {last:.3f} (first and last {WINDOW} steps), less "
                            f"than {REWARD_RISE}")
        # (Each printed reward and the summary's are rounded to 0.001.)
        if abs(float(summary.group(1)) - first) > 1.1e-3 or abs(float(summary.group(2)) - last) > 1.1e-3:
            failures.append(f"the summary says {summary.group(1)} -> {summary.group(2)}; the steps {first:.3f} -> "
                            f"{last:.3f}")
        above = [(step[2], step[0]) for step in steps if step[2] > MISMATCH]
        if above:
            worst, where = max(above)
            failures.append(f"mismatch above {MISMATCH} nat in {len(above)} steps, the most {worst} nat in step "
                            f"{where}")
        version = int(initial.group(1))
        for step, _, _, generated, published in steps:
            if generated != version or published != version + 1:
                failures.append(f"step {step} generated with version {generated} after version {version} was "
                                f"published, and published version {published}")
            version = published
    for failure in failures:
        print(f"rl_example: FAILED: {failure}", file=sys.stderr, flush=True)
    if failures:
        return 1
    print(f"rl_example: ok ({summary.group(0)[len('rl example: '):]})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
