#!/usr/bin/env python3
"""The pinned copy by how its host memory was allocated, on one CUDA device.

    python3 tests/bench/host_pinned.py [--gb GB] [--repeats N] [--release GB]

Page-locks (cudaHostRegister) a host buffer of GB gigabytes allocated each way, and times the
locking and one flat copy to the device and back (best of N):

- ``torch.empty``: torch's host allocator (what the offload arenas were before);
- ``wsync``: ``wsync.offload.host_memory``, the arenas' allocation now (a mapping of its own,
  2 MiB pages asked for, the device's NUMA node preferred);
- on a host of several NUMA nodes, ``node N``: the same with its pages bound to node N.

Prints the host's NUMA nodes, the device's node and the kernel's transparent huge page
setting, then one line a way:

    host_pinned: WAY: locking L GB/s, to device X GB/s, to host Y GB/s, 2 MiB pages H %

Then the copy each way started 0, 100, 250, 500 and 1000 ms after RELEASE gigabytes of the
device were given back to the driver, by this process (torch's empty_cache) and by another
process (as vLLM's sleep gives its memory back before the trainer's onload):

    host_pinned: DIRECTION after BY released R GB: X GB/s 0 ms later, ...

and the same for a copy to the device by a kernel (a torch elementwise op reading the
page-locked memory through its device address, no copy engine), with its speed before any
release:

    host_pinned: to device by a kernel: X GB/s; after BY released R GB: ...
"""
from __future__ import annotations

import argparse
import ctypes
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bindings" / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload import best_copy_seconds  # noqa: E402 (tests/bench/offload.py: the same timed copy)
from wsync.offload import MPOL_BIND, device_node, host_memory, mbind, numa_nodes, page_lock  # noqa: E402


def huge_share(pointer: int, size: int) -> float:
    """The share of [pointer, pointer + size) that /proc/self/smaps counts in 2 MiB pages."""
    text = Path("/proc/self/smaps").read_text()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        start, end = (int(x, 16) for x in block.split()[0].split("-"))
        if start <= pointer < end:
            found = re.search(r"AnonHugePages:\s+(\d+) kB", block)
            return int(found.group(1)) * 1024 / size if found else 0.0
    return float("nan")


def bind(pointer: int, size: int, node: int) -> None:
    """Binds the (page-aligned, untouched) pages of [pointer, pointer + size) to ``node``."""
    if not mbind(pointer, size, node, MPOL_BIND):
        raise OSError(ctypes.get_errno(), f"mbind to node {node}")


def measure(torch, host, repeats: int) -> dict[str, float]:
    size = host.numel()
    cudart = torch.cuda.cudart()
    started = time.perf_counter()
    page_lock(torch, host.data_ptr(), size, "the benchmark's buffer")
    locking = time.perf_counter() - started
    found = {"locking": size / locking / 1e9, "huge": huge_share(host.data_ptr(), size)}
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    try:
        for name, (dst, src) in {"to device": (device, host), "to host": (host, device)}.items():
            found[name] = size / best_copy_seconds(torch, dst, src, repeats) / 1e9
    finally:
        cudart.cudaHostUnregister(host.data_ptr())
        del device
        torch.cuda.empty_cache()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=4.0, help="the buffer's size (default 4 GB)")
    parser.add_argument("--repeats", type=int, default=5, help="copies each way, the best kept (default 5)")
    parser.add_argument("--release", type=float, default=100.0,
                        help="the device memory given back before the copy (default 100 GB)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("host_pinned: no CUDA device", file=sys.stderr)
        return 2
    size = int(args.gb * 1e9)
    nodes = numa_nodes()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"host_pinned: {len(nodes)} NUMA node(s) {nodes}, the device's {device_node(torch)}; "
          f"transparent huge pages: {thp.read_text().strip() if thp.exists() else 'not said'}; {args.gb:g} GB")
    ways = {"torch.empty": lambda: torch.empty(size, dtype=torch.uint8),
            "wsync": lambda: host_memory(torch, size, device_node(torch))}
    if len(nodes) > 1:
        for node in nodes:
            def bound(node=node):
                host = host_memory(torch, size)
                bind(host.data_ptr(), size, node)
                return host
            ways[f"node {node}"] = bound
    for way, allocate in ways.items():
        host = allocate()
        figures = measure(torch, host, args.repeats)
        del host
        print(f"host_pinned: {way}: locking {figures['locking']:.1f} GB/s, to device {figures['to device']:.1f} GB/s, "
              f"to host {figures['to host']:.1f} GB/s, 2 MiB pages {figures['huge'] * 100:.0f} %")
    host = host_memory(torch, size)
    cudart = torch.cuda.cudart()
    page_lock(torch, host.data_ptr(), size, "the benchmark's buffer")
    release = int(args.release * 1e9)
    try:
        for by in ("this process", "another process"):
            with Releaser(torch, release, by) as releaser:
                for direction in ("to device", "to host"):
                    speeds = [copy_after_release(torch, host, releaser, direction, delay) for delay in DELAYS]
                    print(f"host_pinned: {direction} after {by} released {args.release:g} GB: "
                          + ", ".join(f"{speed:.1f} GB/s {delay * 1e3:.0f} ms later"
                                      for delay, speed in zip(DELAYS, speeds)))
        alone = max(kernel_copy_speed(torch, host, None, 0.0) for _ in range(3))
        for by in ("this process", "another process"):
            with Releaser(torch, release, by) as releaser:
                speeds = [kernel_copy_speed(torch, host, releaser, delay) for delay in DELAYS]
            print(f"host_pinned: to device by a kernel: {alone:.1f} GB/s; after {by} released {args.release:g} GB: "
                  + ", ".join(f"{speed:.1f} GB/s {delay * 1e3:.0f} ms later" for delay, speed in zip(DELAYS, speeds)))
    finally:
        cudart.cudaHostUnregister(host.data_ptr())
    return 0


#: How long after the release each timed copy starts (seconds).
DELAYS = (0.0, 0.1, 0.25, 0.5, 1.0)

HOLDER = """
import sys, torch
size = int(sys.argv[1])
while sys.stdin.readline().strip() == "hold":
    memory = torch.empty(size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print("held", flush=True)
    sys.stdin.readline()
    del memory
    torch.cuda.empty_cache()
    print("released", flush=True)
"""


class Releaser:
    """Takes ``release`` bytes of the device and gives them back to the driver, again at each
    ``cycle``: in this process (torch's empty_cache) or in another one it keeps for that (as
    vLLM's sleep gives its memory back before the trainer's onload)."""

    def __init__(self, torch, release: int, by: str) -> None:
        self.torch, self.release, self.holder = torch, release, None
        if by != "this process":
            import subprocess  # noqa: PLC0415
            self.holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(release)], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True)

    def _said(self, line: str, answer: str) -> None:
        self.holder.stdin.write(line + "\n")
        self.holder.stdin.flush()
        heard = self.holder.stdout.readline().strip()
        if heard != answer:
            raise RuntimeError(f"the holder process answered {heard!r}, not {answer!r}")

    def cycle(self) -> None:
        """Takes the bytes, then gives them back; returns once they are given back."""
        if self.holder is None:
            memory = self.torch.empty(self.release, dtype=self.torch.uint8, device="cuda")
            self.torch.cuda.synchronize()
            del memory
            self.torch.cuda.empty_cache()
        else:
            self._said("hold", "held")
            self._said("free", "released")

    def __enter__(self) -> "Releaser":
        return self

    def __exit__(self, *_: object) -> None:
        if self.holder is not None:
            self.holder.stdin.close()  # (its loop ends at end of input)
            self.holder.wait(timeout=60)


def copy_after_release(torch, host, releaser: Releaser, direction: str, delay: float) -> float:
    """GB/s of one copy of ``host``'s bytes to device memory allocated right after the
    releaser gave its bytes back to the driver, as an onload's is (``direction`` "to
    device"), or back from it ("to host"), started ``delay`` seconds after the release."""
    releaser.cycle()
    released = time.perf_counter()
    device = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
    try:
        time.sleep(max(0.0, released + delay - time.perf_counter()))
        dst, src = (device, host) if direction == "to device" else (host, device)
        return host.numel() / best_copy_seconds(torch, dst, src, 1) / 1e9
    finally:
        del device
        torch.cuda.empty_cache()


def device_view(torch, host) -> "torch.Tensor":
    """A CUDA tensor over the page-locked host tensor ``host``'s own bytes (64-bit words), at
    its device address (the host address, under unified addressing): what a kernel reads
    across the bus."""
    class Interface:
        __cuda_array_interface__ = {"shape": (host.numel() // 8,), "typestr": "<i8", "version": 3,
                                    "data": (host.data_ptr(), False), "strides": None}
    return torch.as_tensor(Interface(), device="cuda")


def kernel_copy_speed(torch, host, releaser: "Releaser | None", delay: float) -> float:
    """GB/s of one copy of ``host``'s bytes to device memory by a kernel (torch's elementwise
    bitwise_or with 0: each thread reads host words, no copy engine), started ``delay``
    seconds after the releaser's release (None: none)."""
    if releaser is not None:
        releaser.cycle()
    released = time.perf_counter()
    source = device_view(torch, host)
    target = torch.empty_like(source)
    try:
        time.sleep(max(0.0, released + delay - time.perf_counter()))
        torch.cuda.synchronize()
        started = time.perf_counter()
        torch.bitwise_or(source, 0, out=target)
        torch.cuda.synchronize()
        return source.numel() * 8 / (time.perf_counter() - started) / 1e9
    finally:
        del source, target
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
