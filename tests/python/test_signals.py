"""Ctrl-C (SIGINT) and a SIGTERM handler that raises SystemExit in a single-process trainer
(wsync.Host(recipe) on tests/fixtures/recipes/external_one_rank.lua) during a publication:
the exception comes out of ``publish`` itself, the session is stopped fail-stop, and
nothing of it is left: no process, nothing in TMPDIR. A signal that arrives as libwsync
enters a Python callback is raised at the callback's first instruction, before any
``try`` in it; ctypes can only report it as ignored and return an undefined int to C,
which the confirmed callback protocol (*done) turns into a failed step."""
from __future__ import annotations

import signal
import textwrap
import time

import pytest

from conftest import run_session, run_trainer

RECIPE = "tests/fixtures/recipes/external_one_rank.lua"

TRAINER = textwrap.dedent("""
    import os
    import signal
    import sys
    import threading
    import numpy as np
    import synthetic
    import wsync
    from marks import children

    SIGNAL = getattr(signal, SIGNAL_NAME)
    if SIGNAL == signal.SIGTERM:
        def stop(number, frame):
            sys.exit(143)
        signal.signal(signal.SIGTERM, stop)
    main = threading.main_thread()

    def signal_at_next_entry():
        # The schedule calls offload_optimizer, then the publication runs in C, then
        # offload_actor. A helper thread sends the signal once this callback returned to C
        # (the main thread's newest frame is again the one that called into libwsync), so
        # that it is pending when the main thread next runs Python: the next callback's
        # first instruction. (It spins: it then holds the GIL as this callback returns.)
        caller = sys._getframe(2)  # this callback <- the agent's trampoline <- the caller
        def send():
            while sys._current_frames().get(main.ident) is not caller:
                pass
            os.kill(os.getpid(), SIGNAL)
        threading.Thread(target=send, daemon=True).start()

    def signal_inside():
        os.kill(os.getpid(), SIGNAL)
        threading.Event().wait(30)  # interrupted

    shards = {name: np.zeros(shape, dtype=np.uint16) for name, shape in synthetic.layout()}
    for round in range(ROUNDS):
        where = "outside publish"
        try:
            with wsync.Host(RECIPE) as host:
                agent = host.agent(rank=0, world=1)
                for name, shard in shards.items():
                    agent.register_tensor(name, shard, dtype="bfloat16")
                for step in ("offload_optimizer", "onload_optimizer", "offload_actor", "onload_actor"):
                    agent.register_callback(step, lambda: None)
                agent.register_callback("offload_optimizer", signal_at_next_entry if WHERE == "entry" else signal_inside)
                agent.ready()
                for name, shard in shards.items():
                    synthetic.fill(shard, name, shard.shape, 0, 1)
                try:
                    agent.publish(1)
                except BaseException:
                    where = "publish"
                    raise
            print(f"round {round}: published", flush=True)
        except BaseException as err:
            cause = str(err.__cause__).splitlines()[0] if err.__cause__ else None
            print(f"round {round}: {type(err).__name__} from {where}; cause: {cause}", flush=True)
        print(f"round {round}: children left: {children(os.getpid())}", flush=True)
""")


@pytest.mark.parametrize("where, signal_name, rounds", [
    ("entry", "SIGINT", 5), ("entry", "SIGTERM", 2), ("inside", "SIGINT", 1), ("inside", "SIGTERM", 1)])
def test_a_signal_during_publish_raises_from_publish_and_stops_the_session(tmp_path, where, signal_name, rounds):
    code = f"WHERE = {where!r}\nSIGNAL_NAME = {signal_name!r}\nROUNDS = {rounds}\n" + TRAINER
    result = run_trainer(code, RECIPE, tmp_path)
    output = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, output
    exception = {"SIGINT": "KeyboardInterrupt", "SIGTERM": "SystemExit"}[signal_name]
    # (The old trampoline let the signal's exception be printed as ignored, and the step
    # failed with an undefined return value, or passed when it happened to be 0.)
    assert "Exception ignored" not in result.stderr, output
    lines = [line for line in result.stdout.splitlines() if line.startswith("round ")]
    if where == "entry":
        # offload_actor's entry. (The interrupt check, first called 100 ms into publish,
        # would be the next entry on a machine so slow that the publication's first
        # steps took that long: the same exception, the check's cause.)
        causes = {"publish: [phase callback, rank 0] trainer rank 0: callback 'offload_actor' was interrupted "
                  "before it completed (it did not report done) (CALLBACK_FAILED)",
                  "publish: [rank 0] publish was interrupted (the trainer's interrupt check did not complete): the "
                  "call was abandoned and this rank left its host; this host's session was stopped (INTERRUPTED)"}
    else:
        causes = {"publish: [phase callback, rank 0] trainer rank 0: callback 'offload_optimizer' failed (it "
                  "returned 1) (CALLBACK_FAILED)"}
    assert len(lines) == 2 * rounds, output
    for index in range(rounds):
        raised, _, cause = lines[2 * index].partition("; cause: ")
        assert raised == f"round {index}: {exception} from publish" and cause in causes, output
        assert lines[2 * index + 1] == f"round {index}: children left: []", output
    # Fail-stop: the failed publication destroyed the runtime and closing the host
    # stopped the session (or the interrupt check's abandoned call stopped it).
    assert (result.stdout.count("wsync: host closed: stopping now")
            + result.stdout.count("wsync: interrupted: stopping now")) == rounds, output
    assert list(tmp_path.iterdir()) == [], "the session left files in TMPDIR"


WAITING = textwrap.dedent("""
    import os
    import signal
    import sys
    import threading
    import time
    import numpy as np
    import synthetic
    import wsync
    from marks import children

    SIGNAL = getattr(signal, SIGNAL_NAME)
    if SIGNAL == signal.SIGTERM:
        def stop(number, frame):
            sys.exit(143)
        signal.signal(signal.SIGTERM, stop)
    sent = []

    def send_later():
        time.sleep(0.5)
        sent.append(time.monotonic())
        os.kill(os.getpid(), SIGNAL)

    shards = {name: np.zeros(shape, dtype=np.uint16) for name, shape in synthetic.layout()}
    try:
        with wsync.Host(RECIPE) as host:
            agent = host.agent(rank=0, world=1)
            for name, shard in shards.items():
                agent.register_tensor(name, shard, dtype="bfloat16")
            for step in ("offload_optimizer", "onload_optimizer", "offload_actor", "onload_actor"):
                agent.register_callback(step, lambda: None)
            agent.ready()
            for name, shard in shards.items():
                synthetic.fill(shard, name, shard.shape, 0, 1)
            threading.Thread(target=send_later, daemon=True).start()
            try:
                agent.publish(1)
            except BaseException as err:
                waited = time.monotonic() - sent[0]
                print(f"{type(err).__name__} from publish, {'within' if waited < 2 else 'after'} 2 s; cause: "
                      f"{err.__cause__}", flush=True)
                raise
    except BaseException:
        pass
    print(f"children left: {children(os.getpid())}", flush=True)
""")


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_a_signal_while_publish_waits_on_a_hung_runtime_stops_the_session_at_once(tmp_path, signal_name):
    # The runtime never answers the publication's first load_chunk (the recipe waits 30 s
    # for it). The agent's interrupt check, called every 100 ms while publish waits in C,
    # notices the signal: the call is abandoned and the session stopped fail-stop.
    code = f"SIGNAL_NAME = {signal_name!r}\n" + WAITING
    result = run_trainer(code, RECIPE, tmp_path, env={"WSYNC_RUNTIME_FAULT": "hang@load_chunk"})
    output = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, output
    exception = {"SIGINT": "KeyboardInterrupt", "SIGTERM": "SystemExit"}[signal_name]
    assert (f"{exception} from publish, within 2 s; cause: publish: [rank 0] publish was interrupted (the trainer's "
            "interrupt check did not complete): the call was abandoned and this rank left its host; this host's "
            "session was stopped (INTERRUPTED)\n") in result.stdout, output
    assert "wsync: interrupted: stopping now" in result.stdout, output
    assert "children left: []" in result.stdout, output
    assert "Exception ignored" not in result.stderr, output
    assert list(tmp_path.iterdir()) == [], "the session left files in TMPDIR"


def test_ctrl_c_while_a_rank_waits_for_the_others_makes_it_leave_at_once(marked):
    # `wsync run` with two Python ranks; rank 1 trains for 3 s before its first publish,
    # rank 0 gets Ctrl-C while its publish waits for rank 1. Its interrupt check notices
    # within 100 ms: the call is abandoned, rank 0 leaves the host and raises
    # KeyboardInterrupt (uncaught: Python then exits by SIGINT); the host's session fails
    # on the lost rank, fail-stop, and rank 1's publish fails.
    waited = []

    def interrupt_rank_0(host, ranks):
        marked.wait_for(lambda: "rank 0: publishing version 1" in ranks[0].out, 30, "rank 0 to publish")
        time.sleep(0.5)
        sent = time.monotonic()
        ranks[0].popen.send_signal(signal.SIGINT)
        marked.wait_for(lambda: ranks[0].popen.poll() is not None, 10, "rank 0 to exit")
        waited.append(time.monotonic() - sent)

    host, ranks = run_session(marked, "tests/fixtures/recipes/external_tiny.lua", world=2, versions=1,
                              rank_args={1: ["--step-ms", "3000"]}, while_running=interrupt_rank_0)
    assert ranks[0].popen.returncode == -signal.SIGINT, ranks[0].describe()
    assert waited[0] < 2, f"rank 0 exited {waited[0]:.2f} s after Ctrl-C"
    assert "KeyboardInterrupt" in ranks[0].err and ("publish: [rank 0] publish was interrupted (the trainer's "
                                                    "interrupt check did not complete): the call was abandoned and "
                                                    "this rank left its host (INTERRUPTED)") in ranks[0].err, \
        ranks[0].describe()
    assert "Exception ignored" not in ranks[0].err, ranks[0].describe()
    assert host.popen.returncode == 1, host.describe()
    assert "trainer rank 0 was lost" in host.out + host.err, host.describe()
    assert ranks[1].popen.returncode == 1 and "failed: status EFAILED" in ranks[1].out, ranks[1].describe()
