"""Ctrl-C (SIGINT) and a SIGTERM handler that raises SystemExit in a single-process trainer
(wsync.Host(recipe) on tests/fixtures/recipes/external_one_rank.lua) during a publication:
the exception comes out of ``publish`` itself, the session is stopped fail-stop, and
nothing of it is left: no process, nothing in TMPDIR. A signal that arrives as libwsync
enters a Python callback is raised at the callback's first instruction, before any
``try`` in it; ctypes can only report it as ignored and return an undefined int to C,
which the confirmed callback protocol (*done) turns into a failed step."""
from __future__ import annotations

import textwrap

import pytest

from conftest import run_trainer

RECIPE = "tests/fixtures/recipes/external_one_rank.lua"

TRAINER = textwrap.dedent("""
    import os
    import signal
    import sys
    import threading
    import numpy as np
    import synthetic
    import wsync

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

    def children():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[1] == str(os.getpid()):
                        found.append(pid)
            except OSError:
                pass
        return found

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
        print(f"round {round}: children left: {children()}", flush=True)
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
        cause = ("publish: [phase callback, rank 0] trainer rank 0: callback 'offload_actor' was interrupted "
                 "before it completed (it did not report done) (CALLBACK_FAILED)")
    else:
        cause = ("publish: [phase callback, rank 0] trainer rank 0: callback 'offload_optimizer' failed (it "
                 "returned 1) (CALLBACK_FAILED)")
    expected = []
    for index in range(rounds):
        expected += [f"round {index}: {exception} from publish; cause: {cause}", f"round {index}: children left: []"]
    assert lines == expected, output
    # Fail-stop: the failed publication destroyed the runtime, closing the host stopped
    # the session.
    assert result.stdout.count("wsync: host closed: stopping now") == rounds, output
    assert list(tmp_path.iterdir()) == [], "the session left files in TMPDIR"
