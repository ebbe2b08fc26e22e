"""The RL example (bindings/python/examples/grpo.py) on the CPU: its whole loop (an FSDP2
trainer over gloo, the session in its process, generation through the reference runtime,
the optimizer offloaded and brought back, a publication per step) for three short steps.
What it prints per step and at the end must parse and agree, and nothing of its session
may be left (conftest.Marked). The reference runtime's toy decoder does not generate from
the model, so the reward and the mismatch are not checked for learning here: the GPU tier
does that (tests/gpu/rl_example.py)."""
from __future__ import annotations

import re
import statistics
import sys

from conftest import ROOT

EXAMPLE = ROOT / "bindings" / "python" / "examples" / "grpo.py"
NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
STEP = re.compile(rf"^rl example: step (\d+)/(\d+): reward {NUMBER}, mismatch {NUMBER} nat \(max {NUMBER}\), "
                  rf"version (\d+), generate {NUMBER} ms \((\d+) tok/s\), train {NUMBER} ms, publish {NUMBER} ms "
                  rf"\(publication {NUMBER} ms(?:, commit {NUMBER} ms)?\) -> version (\d+)$", re.MULTILINE)
INITIAL = re.compile(rf"^rl example: initial weights published as version (\d+) in {NUMBER} ms "
                     rf"\(publication {NUMBER} ms\)$", re.MULTILINE)
MEDIANS = re.compile(rf"^rl example: generation median (\d+) tok/s, publication median {NUMBER} ms$", re.MULTILINE)
SUMMARY = re.compile(rf"^rl example: reward {NUMBER} -> {NUMBER} over (\d+) steps, mismatch max {NUMBER} nat, "
                     rf"publish median {NUMBER} ms$", re.MULTILINE)


def example_environment(marked, tmp_path) -> None:
    """torch's own cache (torchinductor_USER, which importing it makes in TMPDIR) out of the
    session's TMPDIR, where Marked.finish looks for what the session left."""
    marked.env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "torchinductor")


def test_the_rl_example_runs_its_loop_on_the_cpu(marked, tmp_path):
    example_environment(marked, tmp_path)
    plot = tmp_path / "rl.png"
    example = marked.start("grpo.py", [sys.executable, str(EXAMPLE), "--device", "cpu", "--recipe",
                                       "recipes/grpo_tiny_cpu.lua", "--steps", "3", "--prompts", "2", "--group", "4",
                                       "--max-tokens", "8", "--plot", str(plot)])
    marked.finish(seconds=300)  # (nothing of the session left: processes, /dev/shm, TMPDIR)
    out = example.describe()
    assert example.popen.returncode == 0, out
    assert "the reward and the mismatch mean nothing here" in example.out, out
    assert "wsync: verdict: OK: 4 model versions published" in example.out, out

    initial = INITIAL.search(example.out)
    assert initial and initial.group(1) == "1", out
    steps = STEP.findall(example.out)
    assert [(int(step[0]), int(step[1])) for step in steps] == [(1, 3), (2, 3), (3, 3)], out
    rewards = [float(step[2]) for step in steps]
    mismatches = [float(step[3]) for step in steps]
    publishes = [float(step[9]) for step in steps]
    publications = [float(step[10]) for step in steps]
    generated = [int(step[5]) for step in steps]
    published = [int(step[12]) for step in steps]
    # Each step generates with the version published just before it and publishes the next.
    assert generated == [1, 2, 3] and published == [2, 3, 4], out
    for step in steps:
        reward, mismatch, worst, tokens_per_second = float(step[2]), float(step[3]), float(step[4]), int(step[7])
        assert 0 <= reward <= 1 and 0 <= mismatch <= worst and tokens_per_second > 0, step
        assert float(step[9]) >= float(step[10]) > 0, f"the publish call took less than its publication: {step}"

    medians = MEDIANS.search(example.out)
    assert medians and float(medians.group(2)) == statistics.median(publications), out
    # The last line: with 3 steps, A and B are the first and the last step's rewards.
    summary = SUMMARY.search(example.out)
    assert summary, out
    assert example.out.rstrip().endswith(summary.group(0)), out
    first, last, count, worst, median = summary.groups()
    assert (float(first), float(last), int(count)) == (rewards[0], rewards[-1], 3), out
    assert float(worst) == max(mismatches) and float(median) == statistics.median(publishes), out

    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "--plot wrote no PNG"


def test_a_device_that_is_not_the_recipes_backend_is_refused_before_anything_starts(marked, tmp_path):
    example_environment(marked, tmp_path)
    example = marked.start("grpo.py", [sys.executable, str(EXAMPLE), "--device", "cuda", "--recipe",
                                       "recipes/grpo_tiny_cpu.lua"])
    marked.finish(seconds=120)
    assert example.popen.returncode == 2, example.describe()
    assert "--device cuda: recipe recipes/grpo_tiny_cpu.lua publishes from host memory" in example.err, \
        example.describe()
