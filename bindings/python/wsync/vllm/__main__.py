"""``python3 -m wsync.vllm``: the vllm runtime's main process, as the wsync host spawns it
(scripts/wsync/runtime/vllm.lua). It serves the host's control channel on fd 3; it is not
meant to be started by hand, and says so when fd 3 is not the host's channel."""
from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import signal
import stat
import sys
import traceback
from typing import Any

from .failure import Failure
from .runtime.commands import Runtime
from .runtime.server import Faults, Server

PR_SET_PDEATHSIG = 1


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m wsync.vllm", description=(
        "The vllm rollout runtime of wsync: owns vllm.LLM and serves the wsync host's control channel on fd 3. "
        "The host starts it (a recipe with runtime.kind = \"vllm\"); by hand it only refuses to run."))
    parser.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
    parser.add_argument("--devices", required=True, help="device index of each TP rank, comma-separated")
    parser.add_argument("--backend", default="cuda", help="the device backend (cuda)")
    parser.add_argument("--model", required=True, help="the model directory vLLM serves")
    parser.add_argument("--load", choices=("direct", "native"), default="direct",
                        help="how weights reach vLLM's parameters")
    parser.add_argument("--check", choices=("first", "every", "never"), default="first",
                        help="when the direct loader is checked bitwise against vLLM's own loader")
    parser.add_argument("--channel", choices=("rpc", "socket"), default="socket",
                        help="how weight commands reach vLLM's workers: collective_rpc, or a socket to each")
    parser.add_argument("--engine-args", default="{}", help="engine arguments for vllm.LLM, a JSON object")
    parser.add_argument("--timeouts", default="{}", help="the host's per-command timeouts in seconds, JSON")
    return parser.parse_args(argv)


def die_with_parent() -> None:
    """Dies with the host (SIGKILL when it goes), and refuses to run on when it has gone
    already: nobody would ever stop this process."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    expected = os.environ.get("WSYNC_PARENT_PID")
    if expected and os.getppid() != int(expected):
        raise SystemExit(f"wsync.vllm: the process that started this one ({expected}) is gone")


def make_engine(options: argparse.Namespace, timeouts: dict[str, float]) -> Any:
    """The engine: vLLM's (wsync.vllm.runtime.engine), or the one $WSYNC_VLLM_ENGINE names
    ("module:Class", for tests of the protocol without vLLM or a GPU)."""
    devices = [int(device) for device in options.devices.split(",") if device != ""]
    if len(devices) != options.tp:
        raise Failure("RUNTIME_START", f"{len(devices)} devices for TP {options.tp}")
    engine_args = json.loads(options.engine_args)
    if not isinstance(engine_args, dict):
        raise Failure("RUNTIME_START", "--engine-args is not a JSON object")
    named = os.environ.get("WSYNC_VLLM_ENGINE")
    if named:
        module_name, _, class_name = named.partition(":")
        engine_class = getattr(importlib.import_module(module_name), class_name)
    else:
        from .runtime.engine import VllmEngine as engine_class
    engine = engine_class(tp=options.tp, devices=devices, backend=options.backend, model=options.model,
                          load=options.load, engine_args=engine_args, timeouts=timeouts)
    engine.check, engine.channel = options.check, options.channel
    return engine


def main(argv: list[str]) -> int:
    options = parse(argv)
    try:
        mode = os.fstat(3).st_mode
    except OSError:
        mode = 0
    if not (stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode)):
        print("wsync.vllm: no control channel on fd 3 (the wsync host starts this runtime: a recipe with "
              "runtime.kind = \"vllm\")", file=sys.stderr)
        return 1
    die_with_parent()
    timeouts = json.loads(options.timeouts)
    try:
        faults = Faults(os.environ.get("WSYNC_RUNTIME_FAULT", ""))
        engine = make_engine(options, timeouts)
    except BaseException as error:  # the handshake says why, then this process ends
        failure = error if isinstance(error, Failure) else Failure(
            "RUNTIME_START", f"{type(error).__name__}: {error}")
        detail = traceback.format_exc()

        def refuse(_payload: dict[str, Any]) -> dict[str, Any]:
            raise Failure(failure.code, f"vllm runtime did not start: {failure.message}")
        server = Server({"info": refuse, "shutdown": lambda _payload: {}}, name="vllm runtime")
        print(detail, file=sys.stderr, flush=True)
        server.after_answer = lambda: setattr(server, "closed", True)
        server.serve()
        return 1
    runtime = Runtime(engine, tp=options.tp, load=options.load, version=_version())
    server = Server({}, name="vllm runtime", faults=faults)
    server.handlers = runtime.handlers(server)
    try:
        why = server.serve()
    finally:
        engine.close()
    if why not in ("EOF", "closed"):
        print(f"wsync.vllm: {why}", file=sys.stderr)
        return 1
    return 0


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("wsync")
    except Exception:
        return "source"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
