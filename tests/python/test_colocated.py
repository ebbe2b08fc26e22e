"""tests/bench/colocated.py on the CPU (tests/fixtures/recipes/colocated_cpu.lua): the loop
in which one publish call is the whole switch between training and generation
(Agent.publish(generate=...)) with the trainer's mixed-precision optimizer state and its
actor offloaded and brought back by the schedule (wsync.OptimizerOffload(params=True),
wsync.ActorOffload), its optimizer state on the host before the runtime starts; and
`wsync check` refusing the recipe without its offload steps. Nothing of the session may
be left (conftest.Marked). Memory is sampled on the GPU only: the H200 runs the
benchmark's figures."""
from __future__ import annotations

import re
import sys

from conftest import ROOT

BENCH = ROOT / "tests" / "bench" / "colocated.py"
STEP = re.compile(r"^colocated: step (\d+)/(\d+): version (\d+), publish call ", re.MULTILINE)


def test_the_colocated_switch_runs_its_loop_on_the_cpu(marked, tmp_path):
    marked.env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "torchinductor")
    bench = marked.start("colocated.py", [sys.executable, str(BENCH), "--device", "cpu", "--steps", "2",
                                          "--prompts", "2", "--group", "2", "--max-tokens", "4"])
    marked.finish(seconds=300)
    out = bench.describe()
    assert bench.popen.returncode == 0, out
    assert re.search(r"^colocated: without its offload steps wsync check refuses "
                     r"tests/fixtures/recipes/colocated_cpu.lua: .*schedule\[3\] \(wake kv_cache\) needs \d+ bytes "
                     r".*: \d+ bytes \([\d.]+ MiB\) over", bench.out, re.MULTILINE), out
    assert re.search(r"the optimizer state \([\d.]+ GiB, masters and moments\) moved to the host", bench.out), out
    # (One publication of the initial weights, then one per step, each generating with
    # the version it published.)
    assert [tuple(int(x) for x in step) for step in STEP.findall(bench.out)] == [(0, 2, 1), (1, 2, 2), (2, 2, 3)], out
    assert "wsync: verdict: OK: 3 model versions published" in bench.out, out
    # (Each offloader's own account of its moves: what beside the copies takes its time.)
    for name in ("offload_actor", "offload_optimizer"):
        assert re.search(rf"^colocated: {name} inside its callback: \d+ ms, of which freeing them \(and emptying the "
                         r"cache\) \d+ ms \(\d+ storages\); .*; the host's step \d+ ms, from its start to the callback -?\d+ ms, "
                         r"from the copies' end to its end -?\d+ ms$", bench.out, re.MULTILINE), out
    for name in ("onload_actor", "onload_optimizer"):
        assert re.search(rf"^colocated: {name} inside its callback: \d+ ms, of which allocating the storages \d+ ms "
                         r"\(\d+ storages, copied by the host\); then waiting for its copies \d+ ms, .*; the host's step \d+ ms, from its start "
                         r"to the callback -?\d+ ms, from the copies' "
                         r"end to its end -?\d+ ms$", bench.out, re.MULTILINE), out
    assert bench.out.rstrip().endswith("colocated: ok (2 RL steps, every rollout of the version just published)"), out
