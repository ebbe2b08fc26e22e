"""A host that dies takes its rollout runtime with it: whatever process holds the session
(a trainer running it in-process with wsync.Host(recipe), or `wsync run`) may be killed by
any signal, SIGKILL included, and within 10 s no process of the run is left, nothing of it
in /dev/shm or TMPDIR. The runtime here is the vllm runtime with the stand-in engine
(tests/python/vllm_stand_in.py), whose "TP workers" are child processes of the runtime that
outlive it ($WSYNC_STAND_IN_WORKERS=linger), as vLLM's EngineCore and workers do: only wsync's guard
(scripts/wsync/control/guard.lua) can end them once the host is gone. Every process of a
run is found by the mark in its environment (conftest.Marked), not by name."""
from __future__ import annotations

import re
import signal
import sys
import textwrap
import time

import pytest

from conftest import HERE, ROOT, Marked, start_host
from marks import marked_pids

RECIPE = "tests/fixtures/recipes/vllm_stand_in_external.lua"

#: What the guard is given to end a dead host's processes: SIGTERM, SIGKILL after its
#: grace period (3 s), with room for a loaded machine.
WITHIN_SECONDS = 10

# A trainer publishing in its own process: two publications, then, by WHERE, it waits
# between publications, or starts a third, which the runtime never finishes (the test
# sets WSYNC_RUNTIME_FAULT=hang@finish_update#3).
TRAINER = textwrap.dedent("""
    import sys, time
    import numpy as np
    import wsync

    RECIPE, WHERE = sys.argv[1], sys.argv[2]
    shards = {t.name: np.zeros(t.shape, dtype=np.uint16) for t in wsync.trainer_tensors(RECIPE)}
    with wsync.Host(RECIPE) as host:
        agent = host.agent(rank=0, world=1)
        for name, shard in shards.items():
            agent.register_tensor(name, shard, dtype="bfloat16")
        step = 0
        def offload():
            print(f"trainer: publishing {step}", flush=True)
        agent.register_callback("offload_optimizer", offload)
        agent.register_callback("onload_optimizer", lambda: None)
        agent.ready()
        for step in (1, 2, 3):
            if step == 3 and WHERE == "between":
                print("trainer: between publications", flush=True)
                time.sleep(3600)
            agent.publish(step)
            print(f"trainer: published {step}", flush=True)
""")


def environment(marked: Marked, fault: str = "") -> None:
    """The stand-in engine behind the vllm runtime, whose own Python imports wsync.vllm
    and the stand-in from the tree."""
    marked.env.update(WSYNC_VLLM_ENGINE="vllm_stand_in:Engine", WSYNC_PYTHON=sys.executable,
                      WSYNC_RUNTIME_FAULT=fault, WSYNC_STAND_IN_WORKERS="linger")
    marked.env["PYTHONPATH"] = f"{ROOT / 'bindings' / 'python'}:{marked.env['PYTHONPATH']}"


def gone_within(marked: Marked, seconds: float) -> float:
    """Seconds until no marked process is left; fails naming them after `seconds`."""
    started = time.monotonic()
    while marked_pids(marked.entry):
        if time.monotonic() - started > seconds:
            left = sorted(marked_pids(marked.entry))
            described = {pid: open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
                         for pid in left}
            raise AssertionError(f"processes of the run still alive {seconds} s after the host died: {described}\n"
                                 + "\n".join(p.describe() for p in marked.procs))
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.mark.parametrize("where", ["between", "mid"])
@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_trainer_killed_takes_its_runtime_with_it(marked, where, signal_number):
    environment(marked, "hang@finish_update#3" if where == "mid" else "")
    trainer = marked.start("trainer", [sys.executable, "-c", TRAINER, RECIPE, where])
    cue = "trainer: between publications" if where == "between" else "trainer: publishing 3"
    marked.wait_for(lambda: cue in trainer.out or trainer.popen.poll() is not None, 60, cue)
    assert trainer.popen.poll() is None, trainer.describe()
    runtime = [pid for pid in marked.seen if pid != trainer.popen.pid]
    assert len(runtime) >= 3, f"the runtime, its engine's worker and the guard were not seen: {runtime}"
    if where == "mid":
        time.sleep(0.5)  # (the third publication reaches its finish, which hangs)
    trainer.popen.send_signal(signal_number)
    seconds = gone_within(marked, WITHIN_SECONDS)
    marked.finish()  # nothing in /dev/shm or TMPDIR either (the guard removed what the host left)
    assert trainer.popen.returncode == -signal_number, trainer.describe()
    assert re.search(r"wsync guard: host pid \d+ is gone; ended the \d+ processes it had started", trainer.err), \
        trainer.describe()
    print(f"{where}, {signal.Signals(signal_number).name}: every process gone {seconds:.2f} s after the signal")


def test_wsync_run_killed_takes_its_runtime_with_it_and_its_ranks_hear_of_it(marked):
    environment(marked)
    host, endpoint = start_host(marked, RECIPE)
    rank = marked.start("rank 0", [sys.executable, str(HERE / "rank.py"), endpoint, "0", "1", "1000"])
    marked.wait_for(lambda: "published version 2" in rank.out or rank.popen.poll() is not None, 60,
                    "two publications")
    host.popen.send_signal(signal.SIGKILL)
    seconds = gone_within(marked, WITHIN_SECONDS)
    marked.finish()
    assert host.popen.returncode == -signal.SIGKILL
    assert rank.popen.returncode == 1, rank.describe()
    lost = (r"(closed the connection \(it ended the session, or is gone\)"
            r"|is gone \(read error: ECONNRESET\))")
    assert re.search(rf"code HOST_LOST, phase publish.*\n.*rank 0: the wsync host at \S+/control.sock \(pid "
                     rf"{host.popen.pid}\) {lost} during publish", rank.out), rank.describe()
    print(f"wsync run, SIGKILL: every process gone {seconds:.2f} s after the signal")
