"""Step callbacks that move a PyTorch trainer's memory out of the device and back, for a
recipe's memory schedule.

    optimizer_offload = wsync.OptimizerOffload(optimizer)   # AdamW's moments
    actor_offload = wsync.ActorOffload(model)               # parameters (FSDP2 shards) and gradients
    optimizer_offload.register(agent)   # "offload_optimizer", "onload_optimizer"
    actor_offload.register(agent)       # "offload_actor", "onload_actor"

Each moves whole storages: every tensor that shares one (a view, FSDP2's sharded parameter
in its padded buffer) keeps its identity, shape and strides, and finds its bytes again after
the onload. An offload copies each storage into a host buffer, waits for the copies, then
frees the device's storage (resized to 0 bytes) and returns the freed memory to the driver,
so that another process (the rollout engine) can take it. An onload allocates the storages
again, each one's copy back queued as soon as it is allocated, and makes the current stream
wait for the copies.

An onload's storages are carved from one device block: the block is allocated (one
cudaMalloc) and handed back to torch's caching allocator just before the storages are, so
that they take its parts, and the next offload gives it back to the driver as one block (one
cudaFree): a 4.4 B model's 603 storages of optimizer state cost 47 ms of cudaMalloc and 74
ms of cudaFree apart. An onload's copies are the copy engine's, or with
``onload_copy="kernel"`` a kernel's: the device's threads read the page-locked arena across
the bus, at 51 GB/s on an H200 against the copy engine's 55, but the copy engine runs at half
its speed for the first 100-250 ms after another process (the rollout engine going to sleep)
gave device memory back to the driver, and an onload follows just that, while the kernel
keeps its speed (tests/bench/host_pinned.py). Where the arena has no device address the copy
engine copies.

The host buffers are one arena per offloader, pinned where CUDA is (page-locked: copies run
at the bus's speed and asynchronously), allocated at the first offload (or ahead of it, by
``reserve``) and reused by every later one; it grows only when the storages to move grow
(an optimizer's state appears at its first step). The arena is a mapping of its own that
CUDA registers (cudaHostRegister), of exactly the bytes it holds: torch's pinned allocator
rounds every allocation up to a power of two, and the 53 GB of a 4.4 B model's
mixed-precision optimizer state would ask it for 128 GiB. The mapping asks the kernel for
2 MiB pages (fewer pages to lock, and for the device to translate as it reads them) and, on
a host of several NUMA nodes, for pages on the device's node (a copy from another node's
memory crosses the link between the sockets). The copies run on a CUDA stream of the
offloader's own, ordered after what the current stream had queued.

``device_bytes`` is what one offload frees on the device (and what its onload takes back);
``last`` says what the last offload or onload moved and how long it took (and of that, how long
freeing the device's storages or allocating them again took). torch is imported
when an offloader first moves something, never by ``import wsync``.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable

#: Where each storage starts in the host arena: a multiple of this many bytes.
ALIGNMENT = 512


def _aligned(size: int) -> int:
    return (size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def device_node(torch: Any, device: Any = None) -> int:
    """The host NUMA node of a CUDA device's PCI function, as sysfs gives it (-1: not known,
    or a host of one node)."""
    properties = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    try:
        address = f"{properties.pci_domain_id:04x}:{properties.pci_bus_id:02x}:{properties.pci_device_id:02x}.0"
        return int(Path(f"/sys/bus/pci/devices/{address}/numa_node").read_text())
    except (AttributeError, OSError, ValueError):
        return -1


_SYS_MBIND = {"x86_64": 237, "aarch64": 235}
MPOL_PREFERRED, MPOL_BIND = 1, 2


def numa_nodes() -> list[int]:
    """The host's NUMA nodes, as sysfs lists them (none where it does not)."""
    return sorted(int(path.name[4:]) for path in Path("/sys/devices/system/node").glob("node[0-9]*"))


def mbind(pointer: int, size: int, node: int, policy: int) -> bool:
    """Sets the NUMA policy (``MPOL_PREFERRED``, ``MPOL_BIND``) of the pages of [pointer,
    pointer + size) (page-aligned, not yet touched) to node ``node``; whether the kernel took
    it."""
    number = _SYS_MBIND.get(os.uname().machine)
    if number is None or not 0 <= node < 64:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    mask = ctypes.c_ulong(1 << node)
    return libc.syscall(number, ctypes.c_void_p(pointer), ctypes.c_ulong(size), policy,
                        ctypes.byref(mask), ctypes.c_ulong(64), 0) == 0


def host_memory(torch: Any, size: int, node: int = -1) -> Any:
    """A uint8 host tensor of ``size`` bytes on an anonymous mapping of its own, for an
    arena: 2 MiB pages asked for (madvise), and pages on NUMA node ``node`` preferred where
    the host has several. Its pages are touched (and taken) when first written or locked."""
    region = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(region, dtype=torch.uint8)
    with contextlib.suppress(AttributeError, OSError):  # (a kernel without THP: 4 KiB pages)
        region.madvise(mmap.MADV_HUGEPAGE)
    if node >= 0 and len(numa_nodes()) > 1:  # (on a host of one node there is nothing to prefer)
        mbind(tensor.data_ptr(), len(region), node, MPOL_PREFERRED)
    return tensor


def page_lock(torch: Any, pointer: int, size: int, what: str) -> None:
    """Page-locks (cudaHostRegister) the host memory [pointer, pointer + size) for CUDA;
    raises RuntimeError naming ``what`` when CUDA refuses."""
    status = torch.cuda.cudart().cudaHostRegister(pointer, size, 0)
    if int(getattr(status, "value", status)) != 0:
        raise RuntimeError(f"cannot page-lock {size} bytes of host memory for {what} (cudaHostRegister: {status})")


def device_alias(torch: Any, host: Any, device: Any) -> Any:
    """The page-locked host tensor ``host`` as a uint8 tensor of CUDA device ``device`` at
    its device address (cuMemHostGetDevicePointer; under unified addressing, the host
    address), for kernels that read or write it across the bus; None where the driver gives
    none or torch would not take it as it is."""
    pointer = ctypes.c_uint64()
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # (a runtime call: the device's context is current in this thread)
            status = driver.cuMemHostGetDevicePointer_v2(ctypes.byref(pointer), ctypes.c_void_p(host.data_ptr()), 0)
    except (OSError, AttributeError):
        return None
    if status != 0 or pointer.value == 0:
        return None

    class Interface:
        __cuda_array_interface__ = {"shape": (host.numel(),), "typestr": "|u1", "version": 3,
                                    "data": (pointer.value, False), "strides": None}
    try:
        alias = torch.as_tensor(Interface(), device=device)
    except (RuntimeError, TypeError, ValueError):
        return None
    # (torch.as_tensor copies a tensor it finds on another device: then it is no alias.)
    return alias if alias.data_ptr() == pointer.value and alias.device == device else None


def kernel_copy(torch: Any, target: Any, source: Any) -> None:
    """Copies the uint8 tensor ``source`` into ``target`` (same size, CUDA, one of them
    possibly page-locked host memory at its device address) by a kernel on the current
    stream: an elementwise op (bitwise or with 0) in the widest integer unit that the size
    and both addresses allow, so that the threads' loads are wide."""
    size = target.numel()
    for unit in (torch.int64, torch.int32, torch.int16, torch.uint8):
        width = torch.iinfo(unit).bits // 8
        if size % width == 0 and target.data_ptr() % width == 0 and source.data_ptr() % width == 0:
            torch.bitwise_or(source.view(unit), 0, out=target.view(unit))
            return


def _carve_block(torch: Any, device: Any, layout: list[tuple[Any, int, int]]) -> None:
    """Makes torch's caching allocator hold one free device block as large as the storages
    of ``layout`` that it serves from its large pool (over 1 MiB, each rounded to 512 bytes),
    so that their allocations just after are parts of it: one cudaMalloc now, one cudaFree
    when they are all freed and the cache emptied."""
    rounded = ((size + 511) // 512 * 512 for _, size, _ in layout)
    total = sum(size for size in rounded if size > 1 << 20)
    if total > 0:
        try:
            block = torch.empty(total, dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError:  # (not in one piece: the storages find their own)
            return
        del block


def _pin(torch: Any, arena: Any, owner: "_Offloader") -> Any:
    """Page-locks `arena` (a host tensor) for CUDA; returns what unregisters it, once: called
    before the arena is let go, or when `owner` is collected (before its arena is freed), or
    at exit."""
    pointer = arena.data_ptr()
    page_lock(torch, pointer, arena.numel(), f"{owner.what}'s offload")
    return weakref.finalize(owner, torch.cuda.cudart().cudaHostUnregister, pointer)


class _Offloader:
    """Moves the storages of the tensors ``tensors()`` names (each call names them as they
    are now; of a DTensor, this rank's local shard) to host memory and back. ``what`` names
    it in errors ("the optimizer")."""

    #: The callback names ``register`` gives (offload, onload).
    NAMES: tuple[str, str] = ("", "")

    def __init__(self, what: str, tensors: Callable[[], Iterable[Any]], onload_copy: str = "engine") -> None:
        if onload_copy not in ("kernel", "engine"):
            raise ValueError(f"{what}'s offload: onload_copy {onload_copy!r} is neither 'kernel' nor 'engine'")
        self.what = what
        self.onload_copy = onload_copy
        self._tensors = tensors
        self.offloaded: list[tuple[Any, int, int]] = []  # (storage, its bytes, its offset in the arena)
        self.moved = 0  # tensors moved by every offload so far
        self.device_bytes = 0  # bytes freed on the device by the last offload
        self.last: dict[str, Any] = {}
        self._arena: Any = None
        self._unpin: Any = None  # (unregisters the arena from CUDA: called before it is freed)
        self._alias: Any = None  # (the arena at its device address, for the kernel's copies; False: none)
        self._stream: Any = None

    def register(self, agent: Any) -> None:
        """Registers ``offload`` and ``onload`` as ``agent``'s step callbacks, under this
        offloader's names (``NAMES``)."""
        offload_name, onload_name = self.NAMES
        agent.register_callback(offload_name, self.offload)
        agent.register_callback(onload_name, self.onload)

    def _storages(self, torch: Any) -> tuple[list[tuple[Any, int]], int]:
        """The distinct non-empty storages of the tensors, in the order first met, with their
        sizes; and how many tensors lie in them."""
        found: dict[int, Any] = {}
        count = 0
        with torch.no_grad():  # (a DTensor's to_local() is then its local tensor: no new view, no graph node)
            for tensor in self._tensors():
                if not torch.is_tensor(tensor):
                    continue
                if hasattr(tensor, "to_local"):  # (a DTensor: this rank's shard is what it holds)
                    tensor = tensor.to_local()
                storage = tensor.untyped_storage()
                if storage.nbytes() == 0:
                    continue
                count += 1
                found.setdefault(storage.data_ptr(), storage)
        return [(storage, storage.nbytes()) for storage in found.values()], count

    def _arena_of(self, torch: Any, size: int, device: Any) -> Any:
        """The arena, of ``size`` bytes at least: page-locked for CUDA device ``device``
        (None: plain host memory)."""
        if self._arena is None or self._arena.numel() < size:
            if self._unpin is not None:
                self._unpin()
            self._arena, self._unpin, self._alias = None, None, None  # (the old one freed before the new one)
            if device is not None:
                arena = host_memory(torch, size, device_node(torch, device))
                self._unpin = _pin(torch, arena, self)
            else:
                arena = torch.empty(max(size, 1), dtype=torch.uint8)
            self._arena = arena
        return self._arena

    def _layout(self, torch: Any) -> tuple[list[tuple[Any, int, int]], int, int, Any]:
        """Where each storage goes in the arena: (storage, its bytes, its offset) each; the
        arena's bytes; how many tensors lie in the storages; their CUDA device (None: none
        is on one)."""
        storages, tensors = self._storages(torch)
        device = next((storage.device for storage, _ in storages if storage.device.type == "cuda"), None)
        layout, total = [], 0
        for storage, size in storages:
            layout.append((storage, size, total))
            total += _aligned(size)
        return layout, total, tensors, device

    def reserve(self) -> int:
        """Allocates (and page-locks) the arena for the storages as they are now, so that the
        first offload does not: locking takes about a second for every few GB, and the
        pages are easier to find before the rollout engine's processes take host memory.
        Returns the arena's bytes."""
        import torch  # noqa: PLC0415
        _, total, _, device = self._layout(torch)
        return self._arena_of(torch, total, device).numel()

    def _stream_for(self, torch: Any, cuda: bool) -> Any:
        if not cuda:
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    @staticmethod
    def _bytes_of(torch: Any, storage: Any, size: int) -> Any:
        """A flat uint8 tensor over all of ``storage``."""
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (size,), (1,))

    def _arena_on_device(self, torch: Any, device: Any) -> Any:
        """The arena as a uint8 tensor of CUDA device ``device`` at its device address (what
        a kernel reads across the bus), or None where it has none."""
        if self._alias is None:
            alias = device_alias(torch, self._arena, device)
            self._alias = False if alias is None else alias  # (False: looked for, none)
        return None if self._alias is False else self._alias

    def offload(self) -> int:
        """Copies every storage to the host arena, then frees it on the device (the step
        callback ``NAMES[0]``); returns the bytes it moved (the run report's)."""
        import torch  # noqa: PLC0415 (only a trainer that moves memory needs it)
        if self.offloaded:
            raise RuntimeError(f"{self.NAMES[0]}: {self.what} is offloaded already")
        started = time.perf_counter()
        layout, total, tensors, device = self._layout(torch)
        arena = self._arena_of(torch, total, device)
        stream = self._stream_for(torch, device is not None)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for storage, size, offset in layout:
                    arena[offset:offset + size].copy_(self._bytes_of(torch, storage, size), non_blocking=True)
            stream.synchronize()
        else:
            for storage, size, offset in layout:
                arena[offset:offset + size].copy_(self._bytes_of(torch, storage, size))
        copied = time.perf_counter()
        for storage, _, _ in layout:
            storage.resize_(0)
        if device is not None:
            torch.cuda.empty_cache()
        self.offloaded = layout
        self.moved += tensors
        self.device_bytes = sum(size for _, size, _ in layout)
        ended = time.perf_counter()
        self.last = {"step": self.NAMES[0], "bytes": self.device_bytes, "storages": len(layout),
                     "seconds": ended - started, "free_seconds": ended - copied}
        return self.device_bytes

    def onload(self) -> int:
        """Allocates every offloaded storage again and copies its bytes back (the step
        callback ``NAMES[1]``); the current stream waits for the copies. Returns the bytes it
        moved."""
        import torch  # noqa: PLC0415
        started = time.perf_counter()
        layout, arena = self.offloaded, self._arena
        device = next((storage.device for storage, _, _ in layout if storage.device.type == "cuda"), None)
        stream = self._stream_for(torch, device is not None)
        current = torch.cuda.current_stream() if stream is not None else None
        source = arena
        if stream is not None:
            stream.wait_stream(current)
            alias = self._arena_on_device(torch, device) if self.onload_copy == "kernel" else None
            if alias is not None:
                source = alias
            _carve_block(torch, device, layout)
        by_kernel = source is not arena
        allocating = 0.0
        # (Each storage's copy is queued as soon as it is allocated, on the current stream as
        # before its offload, so that the copies run while the rest are.)
        for storage, size, offset in layout:
            before = time.perf_counter()
            storage.resize_(size)
            allocating += time.perf_counter() - before
            target = self._bytes_of(torch, storage, size)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if by_kernel:
                    kernel_copy(torch, target, source[offset:offset + size])
                else:
                    target.copy_(arena[offset:offset + size], non_blocking=stream is not None)
        if stream is not None:
            current.wait_stream(stream)
        moved = sum(size for _, size, _ in layout)
        self.offloaded = []
        self.last = {"step": self.NAMES[1], "bytes": moved, "storages": len(layout),
                     "seconds": time.perf_counter() - started, "allocate_seconds": allocating,
                     "copy": "kernel" if by_kernel else "engine" if stream is not None else "host"}
        return moved

    def synchronize(self) -> None:
        """Waits until the last onload's copies are done (an onload returns once they are
        queued)."""
        if self._stream is not None:
            self._stream.synchronize()


class OptimizerOffload(_Offloader):
    """Moves an optimizer's state tensors (AdamW's ``exp_avg``, ``exp_avg_sq``) to host
    memory (``offload``, the step callback ``"offload_optimizer"``) and back (``onload``,
    ``"onload_optimizer"``). Scalars stay where they are (AdamW's ``step`` counters are
    0-dimensional). Under FSDP2 the state is sharded as the parameters are: this rank's
    shards move. With ``params=True`` the parameters the optimizer steps move too: the
    float32 master copies of mixed-precision training, where the model holds bfloat16
    parameters of its own (they and their moments are the memory model's optimizer state,
    ``memory.optimizer_factor = 6``)."""

    NAMES = ("offload_optimizer", "onload_optimizer")

    def __init__(self, optimizer: Any, params: bool = False, onload_copy: str = "engine") -> None:
        def tensors() -> Iterable[Any]:
            if params:
                for group in optimizer.param_groups:
                    yield from group["params"]
            for state in optimizer.state.values():
                for value in state.values():
                    if getattr(value, "dim", None) is not None and value.dim() > 0:
                        yield value
        super().__init__("the optimizer", tensors, onload_copy)
        self.optimizer = optimizer


class ActorOffload(_Offloader):
    """Moves a module's parameters and their gradients to host memory (``offload``, the step
    callback ``"offload_actor"``) and back (``onload``, ``"onload_actor"``). An FSDP2
    module's parameters are DTensors: this rank's shard is what moves (``to_local()``), in
    the padded buffer FSDP2 keeps it in."""

    NAMES = ("offload_actor", "onload_actor")

    def __init__(self, module: Any, onload_copy: str = "engine") -> None:
        def tensors() -> Iterable[Any]:
            for parameter in module.parameters():
                yield parameter
                if parameter.grad is not None:
                    yield parameter.grad
        super().__init__("the actor", tensors, onload_copy)
        self.module = module
