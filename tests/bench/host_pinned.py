#!/usr/bin/env python3
"""The pinned copy by how its host memory was allocated, on one CUDA device.

    python3 tests/bench/host_pinned.py [--gb GB] [--repeats N]

Page-locks (cudaHostRegister) a host buffer of GB gigabytes allocated each way, and times the
locking and one flat copy to the device and back (best of N):

- ``torch.empty``: torch's host allocator (what the offload arenas were before);
- ``wsync``: ``wsync.offload.host_memory``, the arenas' allocation now (a mapping of its own,
  2 MiB pages asked for, the device's NUMA node preferred);
- on a host of several NUMA nodes, ``node N``: the same with its pages bound to node N.

Prints the host's NUMA nodes, the device's node and the kernel's transparent huge page
setting, then one line a way:

    host_pinned: WAY: locking L GB/s, to device X GB/s, to host Y GB/s, 2 MiB pages H %

Then the copy to the device into fresh device memory right after RELEASE gigabytes of the
device were given back to the driver, by this process (torch's empty_cache) and by another
process (as vLLM's sleep gives its memory back before the trainer's onload), against the
same copy a second later:

    host_pinned: to device right after BY released R GB: X GB/s (a second later: Y GB/s)
"""
from __future__ import annotations

import argparse
import ctypes
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bindings" / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload import best_copy_seconds  # noqa: E402 (tests/bench/offload.py: the same timed copy)

MPOL_BIND = 2


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
    from wsync.offload import _SYS_MBIND
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    mask = ctypes.c_ulong(1 << node)
    if libc.syscall(_SYS_MBIND[os.uname().machine], ctypes.c_void_p(pointer), ctypes.c_ulong(size), MPOL_BIND,
                    ctypes.byref(mask), ctypes.c_ulong(64), 0) != 0:
        raise OSError(ctypes.get_errno(), f"mbind to node {node}")


def measure(torch, host, repeats: int) -> dict[str, float]:
    size = host.numel()
    cudart = torch.cuda.cudart()
    started = time.perf_counter()
    status = cudart.cudaHostRegister(host.data_ptr(), size, 0)
    locking = time.perf_counter() - started
    if int(getattr(status, "value", status)) != 0:
        raise RuntimeError(f"cudaHostRegister: {status}")
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

    from wsync.offload import device_node, host_memory
    if not torch.cuda.is_available():
        print("host_pinned: no CUDA device", file=sys.stderr)
        return 2
    size = int(args.gb * 1e9)
    root = Path("/sys/devices/system/node")
    nodes = sorted(int(p.name[4:]) for p in root.glob("node[0-9]*"))
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
    cudart.cudaHostRegister(host.data_ptr(), size, 0)
    try:
        for by in ("this process", "another process"):
            first = copy_after_release(torch, host, int(args.release * 1e9), by, settle=0.0)
            later = copy_after_release(torch, host, int(args.release * 1e9), by, settle=1.0)
            print(f"host_pinned: to device right after {by} released {args.release:g} GB: {first:.1f} GB/s "
                  f"(a second later: {later:.1f} GB/s)")
    finally:
        cudart.cudaHostUnregister(host.data_ptr())
    return 0


HOLDER = """
import sys, torch
memory = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("held", flush=True)
sys.stdin.readline()
del memory
torch.cuda.empty_cache()
print("released", flush=True)
sys.stdin.readline()
"""


def copy_after_release(torch, host, release: int, by: str, settle: float) -> float:
    """GB/s of one copy of ``host`` into device memory allocated after ``release`` bytes
    were given back to the driver (``by`` this process or another), ``settle`` seconds
    later."""
    import subprocess  # noqa: PLC0415
    holder = None
    if by == "this process":
        memory = torch.empty(release, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        del memory
        torch.cuda.empty_cache()
    else:
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(release)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
    try:
        time.sleep(settle)
        device = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
        took = best_copy_seconds(torch, device, host, 1)
        del device
        torch.cuda.empty_cache()
    finally:
        if holder is not None:
            holder.stdin.write("\n")
            holder.stdin.close()
            holder.wait(timeout=60)
    return host.numel() / took / 1e9


if __name__ == "__main__":
    sys.exit(main())
