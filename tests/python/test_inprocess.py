"""wsync.Host(recipe): a single-process trainer runs the session in its own process (the
endpoint, the runtime's spawn and the publications all advance inside the agent's calls),
on tests/fixtures/recipes/external_one_rank.lua (one rank, TP1, host backend, every
resident slice checked after each of the three publications)."""
from __future__ import annotations

import json
import textwrap
import time

import pytest

from conftest import run_trainer

RECIPE = "tests/fixtures/recipes/external_one_rank.lua"

TRAINER = textwrap.dedent("""
    import numpy as np
    import synthetic
    import wsync

    shards = {name: np.zeros(shape, dtype=np.uint16) for name, shape in synthetic.layout()}
    with wsync.Host(RECIPE) as host:
        agent = host.agent(rank=0, world=1)
        for name, shard in shards.items():
            agent.register_tensor(name, shard, dtype="bfloat16")
        for step in ("offload_optimizer", "onload_optimizer", "offload_actor", "onload_actor"):
            agent.register_callback(step, lambda: None)
        agent.ready()
        for version in (1, 2, 3):
            for name, shard in shards.items():
                synthetic.fill(shard, name, shard.shape, 0, version)
            publication = agent.publish(version)
            print(f"trainer: published step {version} as model version {publication.model_version}", flush=True)
    print("trainer: host closed", flush=True)
""")


def test_a_single_process_trainer_runs_its_session_in_process(tmp_path):
    result = run_trainer(TRAINER, RECIPE, tmp_path)
    output = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, output
    assert [line for line in result.stdout.splitlines() if line.startswith("trainer: published")] == [
        f"trainer: published step {v} as model version {v}" for v in (1, 2, 3)], output
    assert "wsync: verdict: OK: 3 model versions published, every resident TP slice verified" in result.stdout, output
    assert result.stdout.rstrip().endswith("trainer: host closed"), output
    assert list(tmp_path.iterdir()) == [], "the session left files in TMPDIR"


def test_a_recipe_with_synthetic_trainers_is_refused_in_process(tmp_path):
    code = textwrap.dedent("""
        import wsync
        try:
            wsync.Host(RECIPE)
        except wsync.WsyncError as err:
            print("refused:", err)
    """)
    result = run_trainer(code, "recipes/demo.lua", tmp_path)
    assert result.returncode == 0, result.stderr
    assert 'an in-process host runs a model recipe whose trainer kind is "external"' in result.stdout, result.stdout
    assert 'this one\'s is "synthetic"' in result.stdout


@pytest.mark.parametrize("where", ["before ready", "after a publication"])
def test_closing_the_host_early_stops_the_session_and_leaves_nothing(tmp_path, where):
    # The trainer leaves without finishing: the session is stopped fail-stop on close
    # (the runtime killed, the endpoint removed), and no process is left.
    code = textwrap.dedent("""
        import os
        import numpy as np
        import synthetic
        import wsync

        shards = {name: np.zeros(shape, dtype=np.uint16) for name, shape in synthetic.layout()}
        host = wsync.Host(RECIPE)
        agent = host.agent(rank=0, world=1)
        for name, shard in shards.items():
            agent.register_tensor(name, shard, dtype="bfloat16")
        for step in ("offload_optimizer", "onload_optimizer", "offload_actor", "onload_actor"):
            agent.register_callback(step, lambda: None)
        if WHERE == "after a publication":
            agent.ready()
            for name, shard in shards.items():
                synthetic.fill(shard, name, shard.shape, 0, 1)
            agent.publish(1)
        host.close()
        children = [pid for pid in os.listdir("/proc") if pid.isdigit()
                    and open(f"/proc/{pid}/stat").read().split()[3] == str(os.getpid())]
        print("children left:", children, flush=True)
    """)
    result = run_trainer(f"WHERE = {where!r}\n" + code, RECIPE, tmp_path)
    output = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, output
    assert "children left: []" in result.stdout, output
    assert "host closed: stopping now" in result.stdout, output
    assert list(tmp_path.iterdir()) == [], "the session left files in TMPDIR"


def test_the_host_leaves_the_trainers_sigpipe_as_it_found_it(tmp_path):
    # libwsync blocks SIGPIPE only while its code runs: SIG_DFL, as a C trainer has it,
    # stays SIG_DFL, unblocked and not pending, after Host(recipe), a publication and close.
    code = textwrap.dedent("""
        import signal
        import numpy as np
        import signals
        import synthetic
        import wsync

        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        before = signals.sigpipe()
        shards = {name: np.zeros(shape, dtype=np.uint16) for name, shape in synthetic.layout()}
        host = wsync.Host(RECIPE)
        print("after Host(recipe):", signals.sigpipe() == before, flush=True)
        agent = host.agent(rank=0, world=1)
        for name, shard in shards.items():
            agent.register_tensor(name, shard, dtype="bfloat16")
        for step in ("offload_optimizer", "onload_optimizer", "offload_actor", "onload_actor"):
            agent.register_callback(step, lambda: print("in a callback:", signals.sigpipe() == before, flush=True))
        agent.ready()
        for name, shard in shards.items():
            synthetic.fill(shard, name, shard.shape, 0, 1)
        agent.publish(1)
        print("after a publication:", signals.sigpipe() == before, flush=True)
        host.close()
        print("after close:", signals.sigpipe() == before, before, flush=True)
    """)
    result = run_trainer(code, RECIPE, tmp_path)
    output = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, output
    lines = [line for line in result.stdout.splitlines() if ":" in line and not line.startswith("wsync:")]
    assert lines == ["after Host(recipe): True", *["in a callback: True"] * 4, "after a publication: True",
                     "after close: True {'ignored': False, 'blocked': False, 'pending': False}"], output
    assert list(tmp_path.iterdir()) == [], "the session left files in TMPDIR"


def test_keyword_overrides_set_the_recipes_fields(tmp_path):
    code = textwrap.dedent("""
        import numpy as np
        import synthetic
        import wsync

        shards = {name: np.zeros(shape, dtype=np.uint16) for name, shape in synthetic.layout()}
        with wsync.Host(RECIPE, trainer__steps=1, verify=False, **{"buffers.bytes": 262144}) as host:
            agent = host.agent(rank=0, world=1)
            for name, shard in shards.items():
                agent.register_tensor(name, shard, dtype="bfloat16")
            for step in ("offload_optimizer", "onload_optimizer", "offload_actor", "onload_actor"):
                agent.register_callback(step, lambda: None)
            agent.ready()
            print("trainer: published", agent.publish(1).model_version, flush=True)
        try:
            wsync.Host(RECIPE, trainer__stpes=1)
        except wsync.WsyncError as err:
            print("refused:", err, flush=True)
    """)
    result = run_trainer(code, RECIPE, tmp_path)
    output = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, output
    assert "trainer: published 1" in result.stdout, output
    assert "buffers 2 x 256.00 KiB" in result.stdout, output
    assert "wsync: verdict: OK: 1 model versions published\n" in result.stdout, output
    assert "refused: " in result.stdout and "has no field 'trainer.stpes' (trainer's fields: kind, ranks, steps, " \
        "storage)" in result.stdout, output


REPORTING_TRAINER = textwrap.dedent("""
    import json
    import numpy as np
    import synthetic
    import wsync

    shards = {name: np.zeros(shape, dtype=np.uint16) for name, shape in synthetic.layout()}
    offloads = []

    def offload_optimizer():
        offloads.append(1)
        if len(offloads) == 2:
            raise RuntimeError("no host memory for the optimizer")
        return 12345  # (the bytes it moved: the run report's)

    with wsync.Host(RECIPE) as host:
        agent = host.agent(rank=0, world=1)
        for name, shard in shards.items():
            agent.register_tensor(name, shard, dtype="bfloat16")
        agent.register_callback("offload_optimizer", offload_optimizer)
        for step in ("onload_optimizer", "offload_actor", "onload_actor"):
            agent.register_callback(step, lambda: None)
        agent.register_callback("onload_optimizer", lambda: True)  # (a bool is no count of bytes)
        agent.ready()
        for name, shard in shards.items():
            synthetic.fill(shard, name, shard.shape, 0, 1)
        publication = agent.publish(1)
        print("PUBLICATION " + json.dumps({"bytes": publication.bytes, "seconds": publication.seconds,
                                           "timings": publication.timings, "report": publication.report}))
        try:
            agent.publish(2)
        except wsync.WsyncError as err:
            print("REPORTS " + json.dumps(host.reports()))
            raise SystemExit(0)
""")


def test_a_publication_and_host_reports_account_for_the_round_failed_ones_included(tmp_path):
    """Agent.publish() returns the publication's bytes and phase timings and its whole round
    (every step timed, the waits for the ranks first); Host.reports() lists every round, the
    one that failed in a schedule step included, in the same structure."""
    result = run_trainer(REPORTING_TRAINER, RECIPE, tmp_path)
    output = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, output
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in result.stdout.splitlines()
             if line.startswith(("PUBLICATION ", "REPORTS "))}
    publication = json.loads(lines["PUBLICATION"])
    assert publication["bytes"] == 405248, output
    assert publication["seconds"] > 0
    phases = ("preflight", "init", "start", "chunks", "fill", "load", "verify", "finish", "release")
    assert all(publication["timings"][phase] >= 0 for phase in phases), publication["timings"]
    assert publication["timings"]["total"] == publication["seconds"]
    report = publication["report"]
    assert report["outcome"] == "ok" and report["error"] is None and report["model_version"] == 1
    assert [step["name"] for step in report["steps"]] == [
        "train_step", "publish_wait", "offload_optimizer", "wake weights", "publish", "resident_check",
        "offload_actor", "wake kv_cache", "sleep 2", "onload_actor", "onload_optimizer"], report["steps"]
    assert all(set(step) == {"name", "kind", "where", "started", "seconds", "bytes", "device_memory",
                                "predicted_bytes", "outcome", "parts"}
               for step in report["steps"])
    # (started: the monotonic clock, in order, each step within the round)
    starts = [step["started"] for step in report["steps"]]
    assert starts == sorted(starts) and time.monotonic() - 600 < starts[0] <= time.monotonic(), starts
    assert all(step["parts"] is None for step in report["steps"])  # (no together step in this schedule)
    assert all(step["device_memory"] is None and step["outcome"] == "ok" for step in report["steps"])
    assert next(step for step in report["steps"] if step["name"] == "publish")["bytes"] == 405248
    moved = {step["name"]: step["bytes"] for step in report["steps"] if step["kind"] == "trainer"}
    assert moved == {"offload_optimizer": 12345, "offload_actor": None, "onload_actor": None,
                     "onload_optimizer": None}, moved
    # The round's steps add up to nearly all of it (the rest: the host's own bookkeeping).
    assert sum(step["seconds"] for step in report["steps"]) <= report["seconds"]
    assert {"phases": ["fill", "load"], "within": "chunks", "why": "chunk k+1 fills while chunk k loads"} in \
        report["overlaps"]

    reports = json.loads(lines["REPORTS"])
    assert [r["round"] for r in reports] == [1, 2]
    assert reports[0]["steps"] == report["steps"] and reports[0]["outcome"] == "ok"
    failed = reports[1]
    assert failed["outcome"] == "failed", failed
    assert failed["error"]["code"] == "CALLBACK_FAILED" and "offload_optimizer" in failed["error"]["message"]
    assert failed["model_version"] is None and failed["committed"] is False and failed["timings"]["total"] is None
    assert [(s["name"], s["outcome"]) for s in failed["steps"]] == [
        ("train_step", "ok"), ("publish_wait", "ok"), ("offload_optimizer", "failed")], failed["steps"]


def test_publish_generates_the_ranks_prompts_with_the_weights_just_published(tmp_path):
    """One publish call is the whole switch: the schedule's "generate" step generates the
    rank's prompts between the memory steps, and its outputs come back with the
    publication; a schedule without "generate" refuses the request and publishes on."""
    code = textwrap.dedent("""
        import json
        import numpy as np
        import synthetic
        import wsync

        def run(recipe, asks):
            shards = {name: np.zeros(shape, dtype=np.uint16) for name, shape in synthetic.layout()}
            with wsync.Host(recipe) as host:
                agent = host.agent(rank=0, world=1)
                for name, shard in shards.items():
                    agent.register_tensor(name, shard, dtype="bfloat16")
                for step in ("offload_optimizer", "onload_optimizer", "offload_actor", "onload_actor"):
                    agent.register_callback(step, lambda: None)
                agent.ready()
                for version in (1, 2, 3):
                    for name, shard in shards.items():
                        synthetic.fill(shard, name, shard.shape, 0, version)
                    ask = asks(version)
                    try:
                        publication = agent.publish(version, generate=ask)
                    except wsync.WsyncError as err:
                        print("refused:", err.code, err, flush=True)
                        publication = agent.publish(version)
                    print("published", publication.model_version, json.dumps(publication.generation,
                                                                                sort_keys=True), flush=True)

        ask = {"prompts": [[1, 2, 3], [7, 8]], "sampling": {"max_tokens": 4}}
        run(RECIPE, lambda version: None if version == 2 else ask)
        run(RECIPE.replace("_generate", ""), lambda version: ask if version == 1 else None)
    """)
    result = run_trainer(code, "tests/fixtures/recipes/external_one_rank_generate.lua", tmp_path)
    output = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, output
    published = [line.split(" ", 2) for line in result.stdout.splitlines() if line.startswith("published ")]
    assert [int(version) for version, _ in [(p[1], p[2]) for p in published]] == [1, 2, 3, 1, 2, 3], output
    generations = [json.loads(p[2]) for p in published]
    for index in (0, 2):  # (versions 1 and 3 of the first run asked)
        generation = generations[index]
        assert generation["model_version"] == index + 1, output
        assert [len(out["token_ids"]) for out in generation["outputs"]] == [4, 4], output
        assert all(out["model_version"] == index + 1 for out in generation["outputs"]), output
    assert generations[1] is None and generations[3:] == [None, None, None], output
    assert "refused: INVALID_ARGUMENT publish: [rank 0] publish was asked to generate, and the recipe's schedule has " \
        "no \"generate\" step after \"publish\"" in result.stdout, output
    assert result.stdout.count("wsync: verdict: OK: 3 model versions published") == 2, output
