"""Helpers of the Python tests: the wsync binary, and sessions of `wsync run` with Python
trainer ranks (tests/python/rank.py) that leave nothing behind.

Every process a session starts carries a mark in its environment and gets a fresh
TMPDIR; /proc is polled meanwhile, so that short-lived children (the runtime, its TP
workers) are known. Afterwards the session reports, and removes so that no later test
trips over it: marked processes still alive, /dev/shm segments named for one of its
processes ("wsync-<pid>-..."), files left in its TMPDIR.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest

from marks import marked_pids

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def run_trainer(code: str, recipe: str, tmp_path, env: Optional[dict[str, str]] = None,
                path: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Runs a single-process trainer (Python `code`, with RECIPE set to `recipe`) from the
    repository root, with a fresh TMPDIR, this directory and `path` on PYTHONPATH, and the
    `env` entries added; returns its CompletedProcess (output captured, 120 s at most)."""
    environment = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=os.pathsep.join(
        filter(None, [str(HERE), *path, os.environ.get("PYTHONPATH")])), **(env or {}))
    return subprocess.run([sys.executable, "-c", f"RECIPE = {recipe!r}\n" + code], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def wsync_binary() -> str:
    path = os.environ.get("WSYNC_BIN") or str(ROOT / "build" / "wsync")
    assert os.access(path, os.X_OK), (f"the wsync binary {path} is not there: build first (scripts/dev.sh build) or "
                                      "set WSYNC_BIN")
    return path


@dataclass
class Proc:
    """A started process and what it printed so far."""

    popen: subprocess.Popen
    name: str
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)

    @property
    def out(self) -> str:
        return "".join(self.stdout)

    @property
    def err(self) -> str:
        return "".join(self.stderr)

    def describe(self) -> str:
        return (f"{self.name} (pid {self.popen.pid}) exited {self.popen.returncode}\n"
                f"stdout:\n{self.out}\nstderr:\n{self.err}")


class Marked:
    """Processes started with a mark, watched until they and what they made are gone."""

    def __init__(self, tmp_path: Path):
        key = "WSYNC_PYTHON_TEST"
        value = f"{os.getpid()}-{uuid.uuid4().hex}"
        self.entry = f"{key}={value}".encode()
        self.tmpdir = tmp_path / "tmp"
        self.tmpdir.mkdir()
        self.env = dict(os.environ, **{key: value, "TMPDIR": str(self.tmpdir)})
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
        self.seen: set[int] = set()
        self.procs: list[Proc] = []
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            self.seen |= marked_pids(self.entry)

    def start(self, name: str, args: list[str]) -> Proc:
        popen = subprocess.Popen(args, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=ROOT)
        proc = Proc(popen, name)
        for stream, sink in ((popen.stdout, proc.stdout), (popen.stderr, proc.stderr)):
            threading.Thread(target=lambda stream=stream, sink=sink: sink.extend(iter(stream.readline, "")),
                             daemon=True).start()
        self.procs.append(proc)
        return proc

    def wait_for(self, predicate: Callable[[], bool], seconds: float, what: str) -> None:
        deadline = time.monotonic() + seconds
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {seconds} s for {what}:\n" + "\n".join(p.describe() for p in self.procs))
            time.sleep(0.01)

    def finish(self, seconds: float = 90, killed: Optional[int] = None) -> None:
        """Waits until every process ended; then checks and removes what outlived them.
        `killed`: the pid of a process killed with SIGKILL, whose control directory
        (TMPDIR/wsync-PID-*) nothing could remove."""
        try:
            self.wait_for(lambda: all(p.popen.poll() is not None for p in self.procs), seconds,
                          "every process to exit")
            for proc in self.procs:
                proc.popen.wait()
            # The host reaps its runtime before it exits; give the kernel a moment to drop
            # what it reaped from /proc.
            deadline = time.monotonic() + 2
            while marked_pids(self.entry) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            self._stop.set()
            self._watcher.join()
            live = sorted(marked_pids(self.entry))
            for pid in live:
                os.kill(pid, signal.SIGKILL)
            for proc in self.procs:
                if proc.popen.poll() is None:
                    proc.popen.kill()
                    proc.popen.wait()
            segments = sorted(name for name in os.listdir("/dev/shm")
                              if (match := re.match(r"wsync-(\d+)-", name)) and int(match.group(1)) in self.seen)
            for name in segments:
                os.unlink(f"/dev/shm/{name}")
            if killed is not None:
                for directory in self.tmpdir.glob(f"wsync-{killed}-*"):
                    for path in directory.iterdir():
                        path.unlink()
                    directory.rmdir()
            files = sorted(str(path) for path in self.tmpdir.rglob("*"))
        assert live == [], f"processes of the session outlived it: {live}"
        assert segments == [], f"shared-memory segments outlived the session: {segments}"
        assert files == [], f"files left in the session's TMPDIR: {files}"
        assert len(self.seen) >= len(self.procs), "the session's processes were not seen in /proc"


@pytest.fixture
def marked(tmp_path: Path):
    runner = Marked(tmp_path)
    yield runner
    runner._stop.set()
    for proc in runner.procs:
        if proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait()


def start_host(marked: Marked, recipe: str, seconds: float = 60) -> tuple[Proc, str]:
    """`wsync run RECIPE` (external ranks), once it printed its endpoint: the host and the
    endpoint."""
    host = marked.start("wsync run", [wsync_binary(), "run", recipe])
    endpoint: list[str] = []

    def listening() -> bool:
        match = re.search(r"waiting for \d+ external trainer ranks? on (\S+)\n", host.out)
        if match:
            endpoint.append(match.group(1))
        return bool(match) or host.popen.poll() is not None

    marked.wait_for(listening, seconds, "the host's endpoint")
    assert endpoint, "the host did not print its endpoint: " + host.describe()
    return host, endpoint[0]


def run_session(marked: Marked, recipe: str, world: int, versions: int,
                rank_args: Optional[dict[int, list[str]]] = None,
                kill_host_when: Optional[Callable[[Proc, list[Proc]], bool]] = None,
                while_running: Optional[Callable[[Proc, list[Proc]], None]] = None) -> tuple[Proc, list[Proc]]:
    """`wsync run RECIPE`, then WORLD Python ranks on the endpoint it printed; waits until all
    ended and checks that nothing is left. `while_running(host, ranks)` is called once the
    ranks started (to drive them: signals). Returns the host and the ranks."""
    host, endpoint = start_host(marked, recipe)
    ranks = [marked.start(f"rank {rank}", [sys.executable, str(HERE / "rank.py"), endpoint, str(rank), str(world),
                                          str(versions), *(rank_args or {}).get(rank, [])])
             for rank in range(world)]
    if while_running is not None:
        while_running(host, ranks)
    if kill_host_when is not None:
        marked.wait_for(lambda: kill_host_when(host, ranks) or host.popen.poll() is not None, 60,
                        "the moment to kill the host")
        host.popen.send_signal(signal.SIGKILL)
    marked.finish(killed=host.popen.pid if kill_host_when is not None else None)
    return host, ranks
