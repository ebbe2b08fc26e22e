"""One trainer rank of the Python tests, on the host backend: numpy shards of the tiny
Qwen3-MoE (this rank's rows of every trainer tensor), four memory callbacks, VERSIONS
publications to the host at ENDPOINT, each after writing the synthetic values of its
version. Prints one line per publication and exits 0 when every one succeeded; a failed
publication prints the WsyncError's fields and exits 1.

    python rank.py ENDPOINT RANK WORLD VERSIONS [--fail-callback NAME] [--wrong-shape NAME]
                   [--skip NAME] [--move] [--random] [--step-ms MS] [--sigpipe-default]
"""
from __future__ import annotations

import argparse
import signal
import sys
import time

import numpy as np

import signals
import synthetic
import wsync


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("rank", type=int)
    parser.add_argument("world", type=int)
    parser.add_argument("versions", type=int)
    parser.add_argument("--fail-callback", help="this callback raises")
    parser.add_argument("--wrong-shape", help="register this tensor with one row too many in its global shape")
    parser.add_argument("--skip", help="do not register this tensor")
    parser.add_argument("--random", action="store_true",
                        help="random values at each version instead of wsync's synthetic ones")
    parser.add_argument("--move", action="store_true",
                        help="offload_actor frees the shards, onload_actor makes new ones (new pointers)")
    parser.add_argument("--step-ms", type=int, default=0,
                        help="each training step's time before its publication (wsync's loop does not run)")
    parser.add_argument("--sigpipe-default", action="store_true",
                        help="SIGPIPE at SIG_DFL, as in a C trainer (Python ignores it); after every wsync "
                        "call, check that wsync left it so (exit 3 otherwise)")
    args = parser.parse_args()
    if args.sigpipe_default:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sigpipe_before = signals.sigpipe()

    def check_signals(call: str) -> None:
        if args.sigpipe_default and signals.sigpipe() != sigpipe_before:
            print(f"rank {args.rank}: after {call}, SIGPIPE is {signals.sigpipe()}, was {sigpipe_before}",
                  file=sys.stderr, flush=True)
            sys.exit(3)
    shards: dict[str, np.ndarray] = {}
    placement: dict[str, tuple[tuple[int, ...], int]] = {}
    for name, shape in synthetic.layout():
        first, count = synthetic.rows(shape[0], args.rank, args.world)
        shards[name] = np.zeros((count, *shape[1:]), dtype=np.uint16)
        placement[name] = (shape, first)
    state = {"actor": "resident", "optimizer": "resident"}
    offloaded: dict[str, np.ndarray] = {}
    moved = 0

    def move(to: str) -> None:
        # --move: the offload keeps the shards aside ("host memory"), the onload makes
        # new arrays while the old ones still exist, so every shard gets a new address.
        nonlocal moved
        if to == "offloaded":
            offloaded.update(shards)
            shards.clear()
        else:
            for name, old in offloaded.items():
                shards[name] = old.copy()
                moved += shards[name].ctypes.data != old.ctypes.data
            offloaded.clear()

    def transition(part: str, to: str, name: str):
        def run() -> None:
            if name == args.fail_callback:
                raise RuntimeError(f"{name} fails on purpose")
            if state[part] == to:
                raise RuntimeError(f"{name}: the {part} is {to} already")
            state[part] = to
            if args.move and part == "actor":
                move(to)
        return run

    with wsync.Agent(args.endpoint, args.rank, args.world) as agent:
        check_signals("Agent()")
        for name, shard in shards.items():
            if name == args.skip:
                continue
            shape, first = placement[name]
            if name == args.wrong_shape:
                shape = (shape[0] + 1, *shape[1:])
            tensor = (lambda name=name: shards[name]) if args.move else shard
            agent.register_tensor(name, tensor, shape=shape, first_row=first, dtype="bfloat16")
        agent.register_callback("offload_optimizer", transition("optimizer", "offloaded", "offload_optimizer"))
        agent.register_callback("onload_optimizer", transition("optimizer", "resident", "onload_optimizer"))
        agent.register_callback("offload_actor", transition("actor", "offloaded", "offload_actor"))
        agent.register_callback("onload_actor", transition("actor", "resident", "onload_actor"))
        try:
            try:
                agent.ready()
            finally:
                check_signals("ready")
            for version in range(1, args.versions + 1):
                time.sleep(args.step_ms / 1000)
                generator = np.random.default_rng(1000 * version + args.rank)
                for name, shard in shards.items():
                    shape, first = placement[name]
                    if args.random:
                        shard[...] = generator.integers(0, 1 << 16, size=shard.shape, dtype=np.uint16)
                    else:
                        synthetic.fill(shard, name, shape, first, version)
                print(f"rank {args.rank}: publishing version {version}", flush=True)
                try:
                    publication = agent.publish(version)
                finally:
                    check_signals("publish")
                print(f"rank {args.rank}: published version {version}: model version {publication.model_version}, "
                      f"manifest {publication.manifest}, receipts {publication.receipts}", flush=True)
                if state != {"actor": "resident", "optimizer": "resident"}:
                    print(f"rank {args.rank}: the schedule left {state}", file=sys.stderr)
                    return 1
            if args.move:
                print(f"rank {args.rank}: moved {moved} shards", flush=True)
        except wsync.WsyncError as err:
            cause = f"{type(err.__cause__).__name__}: {err.__cause__}" if err.__cause__ else None
            print(f"rank {args.rank}: failed: status {err.status}, code {err.code}, phase {err.phase}, "
                  f"rank {err.rank}, python cause {cause}\n{err}", flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
