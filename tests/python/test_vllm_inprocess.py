"""A single-process trainer (wsync.Host(recipe)) publishing into the vllm runtime and
generating through it between publications (Host.generate), with an engine in place of vLLM
(tests/python/vllm_stand_in.py): every publication checked against the trainer's values,
every result stamped with the version committed when it was dispatched."""
from __future__ import annotations

import sys
import textwrap

from conftest import ROOT, run_trainer

RECIPE = "tests/fixtures/recipes/vllm_stand_in_external.lua"

# The trainer's start, for both trainers below: its shards (numpy) registered, ready
# (each goes on inside its `with` block).
READY = """
    import json
    import time
    import numpy as np
    import wsync

    tensors = wsync.trainer_tensors(RECIPE)
    shards = {t.name: np.zeros(t.shape, dtype=np.uint16) for t in tensors}
    with wsync.Host(RECIPE) as host:
        agent = host.agent(rank=0, world=1)
        for name, shard in shards.items():
            agent.register_tensor(name, shard, dtype="bfloat16")
        for step in ("offload_optimizer", "onload_optimizer", "offload_actor", "onload_actor"):
            agent.register_callback(step, lambda: None)
        agent.ready()
"""

TRAINER = textwrap.dedent(READY + """
        rng = np.random.default_rng(7)
        seen = []
        for step in (1, 2, 3):
            for shard in shards.values():
                # finite bfloat16 values (sign, exponent 100..140, any mantissa)
                bits = (rng.integers(0, 2, shard.shape) << 15) | (rng.integers(100, 141, shard.shape) << 7) \\
                    | rng.integers(0, 128, shard.shape)
                shard[...] = bits.astype(np.uint16)
            publication = agent.publish(step)
            result = host.generate([[1, 2, 3], [7]], max_tokens=4)
            seen.append(result["outputs"][0]["token_ids"])
            print("trainer:", json.dumps({"published": publication.model_version,
                                          "stamped": result["model_version"],
                                          "outputs": [o["model_version"] for o in result["outputs"]],
                                          "tokens": [len(o["token_ids"]) for o in result["outputs"]]}), flush=True)
        print("trainer: runtime", host.runtime_info()["runtime"], flush=True)
        reports = host.reports()
        print("trainer: reports", [r["model_version"] for r in reports],
              all(r["timings"]["total"] >= r["timings"]["load"] > 0 for r in reports),
              all(r["timings"]["finish"] >= r["timings"]["commit"] >= 0 for r in reports), flush=True)
        print("trainer: distinct", len({tuple(tokens) for tokens in seen}), flush=True)
    print("trainer: host closed", flush=True)
""")


def test_a_trainer_publishes_into_the_vllm_runtime_and_generates_between(tmp_path):
    # (The runtime's own Python imports wsync.vllm and the stand-in from the tree.)
    result = run_trainer(TRAINER, RECIPE, tmp_path, path=(str(ROOT / "bindings" / "python"),),
                         env={"WSYNC_VLLM_ENGINE": "vllm_stand_in:Engine", "WSYNC_PYTHON": sys.executable})
    output = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, output
    rows = [line for line in result.stdout.splitlines() if line.startswith('trainer: {')]
    assert rows == [f'trainer: {{"published": {v}, "stamped": {v}, "outputs": [{v}, {v}], "tokens": [4, 4]}}'
                    for v in (1, 2, 3)], output
    assert "trainer: runtime vllm" in result.stdout, output
    assert "trainer: reports [1, 2, 3] True True" in result.stdout, output  # (commit: the runtime's, within finish)
    assert "trainer: distinct 3" in result.stdout, output  # what it generates moves with the version
    assert "resident weights verified" in result.stdout, output
    assert "wsync: verdict: OK: 3 model versions published" in result.stdout, output
    assert list(tmp_path.iterdir()) == [], "the session left files in TMPDIR"


KEEP_RECIPE = "tests/fixtures/recipes/vllm_stand_in_keep.lua"

KEEP_TRAINER = textwrap.dedent(READY + """
        ids = host.submit([{"prompt": [1, 2, 3], "max_tokens": 5000}, {"prompt": [9], "max_tokens": 5000}])
        seen = {rid: {"tokens": 0, "spans": []} for rid in ids}
        def poll():
            for request in host.poll()["requests"]:
                got = seen[request["id"]]
                assert request["first_token"] == got["tokens"], (request["first_token"], got["tokens"])
                got["tokens"] += len(request["tokens"])
                got["spans"] = request["spans"]
        for step in (1, 2, 3):
            time.sleep(0.05)  # (they generate meanwhile)
            poll()
            agent.publish(step)
        time.sleep(0.05)
        poll()
        print("trainer:", json.dumps({rid: {"tokens": got["tokens"], "versions": [s["version"] for s in got["spans"]],
                                            "kv": [s.get("kv") for s in got["spans"]],
                                            "contiguous": all(b["first_token"] == a["last_token"] + 1
                                                              for a, b in zip(got["spans"], got["spans"][1:]))}
                                      for rid, got in seen.items()}), flush=True)
""")


def test_streaming_requests_are_held_across_publications_in_keep_mode(tmp_path):
    result = run_trainer(KEEP_TRAINER, KEEP_RECIPE, tmp_path, path=(str(ROOT / "bindings" / "python"),),
                         env={"WSYNC_VLLM_ENGINE": "vllm_stand_in:Engine", "WSYNC_PYTHON": sys.executable})
    output = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, output
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("trainer: {")]
    import json
    requests = json.loads(line[len("trainer: "):])
    assert len(requests) == 2, output
    for request in requests.values():
        assert request["versions"] == [0, 1, 2, 3], output
        assert request["kv"] == [None, "recomputed", "recomputed", "recomputed"], output
        assert request["contiguous"] and request["tokens"] > 4, output
    assert "wsync: verdict: OK: 3 model versions published" in result.stdout, output
