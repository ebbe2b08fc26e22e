"""wsync.Agent: one trainer rank's part of wsync (ws_agent_* of bindings/wsync.h)."""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from types import CodeType, TracebackType
from typing import Any, Callable, Iterator, Mapping, Optional, Union

from . import _native
from .errors import InvalidArgument, StateError, WsyncError, from_status
from .host import Host
from .tensors import Entry, Memory, describe, layout

Export = Union[None, Mapping[str, Optional[str]], Callable[[str], Optional[str]]]

# What a trainer's signal handlers raise to stop it: raised from the agent call they
# interrupted, ahead of any other exception a callback raised.
_INTERRUPTS = (KeyboardInterrupt, SystemExit)

# The code of the functions that libwsync calls (the agents' trampolines and their
# interrupt check). An exception raised at such a function's first instruction, before
# its ``try`` (CPython runs a pending signal's handler there), escapes it: ctypes reports
# it to sys.unraisablehook and returns an undefined value to C, which the confirmed
# callback's *done makes a failure. The hook of Agent._unraisable_kept recognises it by
# these frames.
_TRAMPOLINES: set[CodeType] = set()


def _interrupt_check(_user_data: Any, done: Any) -> int:
    """The agents' interrupt check (ws_agent_set_interrupt_check), which libwsync calls
    every 100 ms while ready or publish waits: a pending signal's handler runs at its
    entry, and a KeyboardInterrupt or SystemExit it raises leaves *done at 0, so that the
    call is abandoned and raises it (Ctrl-C does not wait for the publication's timeouts)."""
    done[0] = 1
    return 0


_TRAMPOLINES.add(_interrupt_check.__code__)
_INTERRUPT_CHECK = _native.CONFIRMED_CALLBACK(_interrupt_check)


def _from_environment(value: Optional[int], variable: str) -> int:
    """`value`, or the integer in environment variable `variable` (a launcher's: torchrun
    sets RANK and WORLD_SIZE) when it is None; InvalidArgument naming it otherwise."""
    if value is not None:
        return int(value)
    text = os.environ.get(variable)
    if text is None or not text.strip().isdigit():
        name = "rank" if variable == "RANK" else "world"
        raise InvalidArgument(f"Agent: no {name} given and ${variable} is "
                              f"{'not set' if text is None else repr(text) + ', not an integer'}", "EINVAL", "Agent")
    return int(text)


def _raised_in_trampoline(traceback: Optional[TracebackType]) -> bool:
    """Whether a traceback passes through one of the agents' trampolines."""
    while traceback is not None:
        if traceback.tb_frame.f_code in _TRAMPOLINES:
            return True
        traceback = traceback.tb_next
    return False


@dataclass(frozen=True)
class Publication:
    """What a publication returns to every rank: the committed version, and where its
    round's time went.

    ``report`` is the round as the host reports it (``wsync run --report``, ``Host.reports()``:
    the same keys): ``steps``, each ``{name, kind, where, seconds, bytes, device_memory,
    outcome}`` in order (``train_step`` and ``publish_wait``: the waits for the ranks; the
    schedule's steps; ``publish``; ``resident_check``), ``timings`` (the publication's
    phases, seconds), ``overlaps`` (which phases run at once), ``seconds`` (the whole round,
    from the last answer to this one), ``receipts``. ``seconds``, ``bytes`` and ``timings``
    are the publication's own, taken from it."""

    model_version: int   # the version the rollout runtime committed
    publication_id: str  # 32 hex digits
    manifest: str        # SHA-256 of the structural records, 64 hex digits
    receipts: int        # TP workers that returned a valid receipt
    bytes: int = 0       # what the publication moved: the model's bytes
    seconds: float = 0.0  # the publication, from its preflight to its commit
    timings: Mapping[str, Optional[float]] = field(default_factory=dict)  # seconds of each phase
    report: Mapping[str, Any] = field(default_factory=dict)  # the whole round (see above)
    # What the schedule's "generate" step generated for this rank (publish(generate=...)):
    # {"model_version", "outputs"}, the outputs of its prompts in order; None when it asked none.
    generation: Optional[Mapping[str, Any]] = None


class Agent:
    """Trainer rank `rank` of `world` joins the publications of a wsync host.

    The host is ``wsync run`` on a recipe whose trainer kind is ``"external"`` (it prints
    the control endpoint to connect to), or this process's own ``Host(recipe)``. Register
    the rank's tensors and the memory schedule's callbacks, call ``ready()`` once, then
    ``publish()`` after every optimizer step, on every rank, with the same step.

    Under a launcher (torchrun) the arguments may come from the environment: `endpoint`
    from ``$WSYNC_ENDPOINT`` (also a C trainer's, read by libwsync), `rank` and `world`
    from ``$RANK`` and ``$WORLD_SIZE``; a missing one is an InvalidArgument naming it.

    Calls block while the host's commands are served: buffers, fills, step callbacks.
    `backend` is ``"host"`` (tensors in CPU memory: numpy arrays, CPU torch tensors) or
    ``"cuda"`` (CUDA torch tensors on device `device`, by default the rank's index).
    """

    def __init__(self, endpoint: Optional[str] = None, rank: Optional[int] = None, world: Optional[int] = None, *,
                 backend: str = "host", device: Optional[int] = None, host: Optional[Host] = None):
        if backend not in ("host", "cuda"):
            raise InvalidArgument(f"Agent: backend {backend!r} is neither 'host' nor 'cuda'", "EINVAL", "Agent")
        rank, world = _from_environment(rank, "RANK"), _from_environment(world, "WORLD_SIZE")
        self.rank, self.world, self.backend = rank, world, backend
        self._own_host = host is None
        self._host = Host() if host is None else host
        self._lib = self._host._lib
        self._entries: dict[str, Entry] = {}
        self._pointers: dict[str, Memory] = {}
        # (The torch tensors' layout when every entry was last found good: see _refresh.)
        self._torch_entries: list[Entry] = []
        self._layout: Any = None
        self._callbacks: list[Any] = []  # the ctypes trampolines, kept alive
        self._callback_error: Optional[BaseException] = None
        self._cuda = False
        handle = ctypes.c_void_p()
        status = self._lib.ws_agent_open(self._host.handle, None if endpoint is None else str(endpoint).encode(),
                                         int(rank), int(world),
                                         backend.encode(), -1 if device is None else int(device),
                                         ctypes.byref(handle))
        if status != 0:
            text = _native.text(self._lib.ws_last_error())
            if self._own_host:
                self._host.close()
            raise from_status(status, text, "Agent")
        self._handle: Optional[ctypes.c_void_p] = handle
        self._call(self._lib.ws_agent_set_interrupt_check(handle, _INTERRUPT_CHECK, None), "Agent")

    # -- registration ------------------------------------------------------------------------

    def _checked(self, call: str) -> ctypes.c_void_p:
        if self._handle is None:
            raise StateError(f"{call}: the agent is closed", "ESTATE", call)
        if threading.get_ident() != self._host._thread:
            raise StateError(f"{call}: an agent is used from the thread that opened its host only", "ESTATE", call)
        return self._handle

    def _call(self, status: int, call: str) -> None:
        caught, self._callback_error = self._callback_error, None
        if status == 0:
            if isinstance(caught, _INTERRUPTS):
                raise caught
            return
        error = from_status(status, _native.text(self._lib.ws_agent_error(self._handle)), call)
        if isinstance(caught, _INTERRUPTS):
            raise caught from error
        if caught is not None:
            raise error from caught
        raise error

    def _keep(self, err: BaseException) -> None:
        """Keeps what a step callback raised, for the agent call in progress to raise: the
        first, unless a later one is an interrupt (KeyboardInterrupt, SystemExit)."""
        kept = self._callback_error
        if kept is None or (isinstance(err, _INTERRUPTS) and not isinstance(kept, _INTERRUPTS)):
            self._callback_error = err

    @contextlib.contextmanager
    def _unraisable_kept(self) -> Iterator[None]:
        """While an agent call may run step callbacks: an exception that escaped one of the
        agent's trampolines (see _TRAMPOLINES) is kept for the call to raise instead of
        printed as ignored; every other unraisable exception goes to the previous hook."""
        previous = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            if _raised_in_trampoline(unraisable.exc_traceback):
                self._keep(unraisable.exc_value if unraisable.exc_value is not None else unraisable.exc_type())
            else:
                previous(unraisable)

        sys.unraisablehook = hook
        try:
            yield
        finally:
            if sys.unraisablehook is hook:
                sys.unraisablehook = previous

    def _run(self, call: str, function: Callable[..., int], *args: Any) -> None:
        """Runs the agent call `function(*args)`, which serves the host's commands (step
        callbacks and the interrupt check included), and raises its failure: a
        KeyboardInterrupt or SystemExit that a callback or the check raised, from the
        WsyncError; the WsyncError, from another exception."""
        self._callback_error = None
        with self._unraisable_kept():
            status = function(*args)
        self._call(status, call)

    def register_tensor(self, name: str, tensor: Any, *, shape: Optional[tuple[int, ...]] = None,
                        first_row: Optional[int] = None, dtype: Optional[str] = None) -> None:
        """Registers one tensor as wsync's trainer tensor `name`.

        `tensor` is this rank's rows of dim 0 of the global `shape` (default: its own shape,
        the whole tensor), from global row `first_row` (default 0): a C-contiguous numpy
        array, a contiguous torch tensor or parameter, an FSDP2 ``DTensor`` sharded
        ``(Shard(0),)`` (its global shape and rows come from its placement), or a callable
        returning the torch tensor as it is now. numpy has no bfloat16: pass ``dtype=
        "bfloat16"`` with a uint16 array of the raw bits. The memory is looked up again at
        every publication, so storage that an offload and a reload moved is read where it is.
        """
        handle = self._checked("register_tensor")
        if name in self._entries:
            raise InvalidArgument(f"register_tensor {name}: registered already on this rank", "EINVAL",
                                  "register_tensor")
        entry = describe(name, tensor, shape, first_row, dtype)
        expected = "cpu" if self.backend == "host" else "cuda"
        if entry.device != expected:
            raise InvalidArgument(f"register_tensor {name}: the tensor is in {entry.device} memory; the "
                                  f"{self.backend} backend moves tensors in {expected} memory", "EINVAL",
                                  "register_tensor")
        memory = entry.resolve()
        dims = len(entry.shape)
        shape_array = (ctypes.c_int64 * dims)(*entry.shape)
        status = self._lib.ws_agent_register_tensor(handle, name.encode(), entry.dtype.encode(), shape_array, dims,
                                                    ctypes.c_void_p(memory.pointer or None), memory.nbytes,
                                                    entry.first_row, entry.row_count)
        self._call(status, "register_tensor")
        self._entries[name] = entry
        self._pointers[name] = memory
        if entry.current is not None:
            self._torch_entries.append(entry)
        self._layout = None
        self._cuda = self._cuda or entry.device == "cuda"

    def register_module(self, module: Any, export: Export = None, prefix: str = "") -> list[str]:
        """Registers every parameter of a ``torch.nn.Module``; returns the wsync names.

        `export` maps a parameter's name to wsync's trainer tensor name: a mapping (a name
        mapped to None is left out; names not in it are kept) or a callable (returning None
        leaves the parameter out). `prefix` goes before every kept name. Parameters are looked
        up by name at every publication (``module.get_parameter``), so a parameter that an
        offload replaced is found.
        """
        names = []
        for parameter_name, _ in module.named_parameters():
            if export is None:
                target: Optional[str] = parameter_name
            elif callable(export):
                target = export(parameter_name)
            else:
                target = export.get(parameter_name, parameter_name)
            if target is None:
                continue
            target = prefix + target
            self.register_tensor(target, lambda name=parameter_name: module.get_parameter(name))
            names.append(target)
        return names

    def register_callback(self, name: str, fn: Callable[[], Any]) -> None:
        """Registers step callback `name` (``"offload_optimizer"``, ``"onload_actor"``, ...)
        that the host's memory schedule calls. An exception in `fn` fails that schedule step
        on every rank; this rank's ``publish`` raises it as the cause of the WsyncError, or,
        a KeyboardInterrupt or SystemExit (Ctrl-C, a SIGTERM handler), raises it itself,
        also when the signal came as the callback was entered. `fn` must not call wsync.
        Storage that `fn` moved is looked up when it returns. `fn` may return the number of
        bytes it moved (an int): the run report shows it as the step's bytes, added up over
        the ranks (wsync.OptimizerOffload's and wsync.ActorOffload's callbacks do)."""
        handle = self._checked("register_callback")
        if not callable(fn):
            raise InvalidArgument(f"register_callback {name}: {fn!r} is not callable", "EINVAL",
                                  "register_callback")

        def trampoline(_user_data: Any, done: Any) -> int:
            # (An exception raised before this try is kept by _unraisable_kept; *done
            # stays 0 and the step fails as interrupted.)
            try:
                moved = fn()
                if isinstance(moved, int) and not isinstance(moved, bool) and 0 <= moved < 2 ** 53:
                    self._lib.ws_agent_report_moved(handle, moved)
                self._synchronize()
                self._refresh(strict=False)
                status = 0
            except BaseException as err:  # noqa: BLE001 (reported through publish)
                self._keep(err)
                status = 1
            done[0] = 1
            return status

        _TRAMPOLINES.add(trampoline.__code__)
        callback = _native.CONFIRMED_CALLBACK(trampoline)
        self._callbacks.append(callback)
        self._call(self._lib.ws_agent_register_confirmed_callback(handle, name.encode(), callback, None),
                   "register_callback")

    def ready(self) -> None:
        """Sends the registration; returns when every rank registered and the host is ready."""
        self._run("ready", self._lib.ws_agent_ready, self._checked("ready"))

    # -- publication -------------------------------------------------------------------------

    def _synchronize(self) -> None:
        """CUDA work queued on torch's streams is finished before wsync reads the memory."""
        if self._cuda:
            torch = sys.modules.get("torch")
            if torch is not None:
                torch.cuda.synchronize()

    def _refresh(self, strict: bool = True) -> None:
        """Tells the agent of every tensor whose memory moved since it last looked. Not
        strict (after a step callback): a tensor that cannot be found now (offloaded) is
        marked not in memory, so that a publication starting so fails and names it.

        When every tensor is a torch tensor and all of them lie as they did when last found
        good (pointers, shapes, strides, dtypes, read at once), nothing is checked again;
        otherwise each entry is, whole."""
        torch = sys.modules.get("torch")
        # (Without autograd a DTensor's to_local() is its local tensor; with it, each call
        # makes a new view and a graph node: this look runs after every step callback.)
        with torch.no_grad() if torch is not None else contextlib.nullcontext():
            self._look(strict)

    def _look(self, strict: bool) -> None:
        now = None
        if self._entries and len(self._torch_entries) == len(self._entries):
            try:
                now = layout([entry.fixed if entry.fixed is not None else entry.current()
                              for entry in self._torch_entries])
            except Exception:  # noqa: BLE001 (a callable that fails: each entry says so below)
                now = None
            if now is not None and now == self._layout:
                return
        self._layout = None
        if self._resolve_each(strict) and now is not None:
            self._layout = now

    def _resolve_each(self, strict: bool) -> bool:
        """Resolves every entry; whether all were found."""
        pointers, found = self._pointers, True
        for name, entry in self._entries.items():
            try:
                memory = entry.resolve()
            except Exception:  # noqa: BLE001 (strict callers see it)
                if strict:
                    raise
                memory, found = Memory(0, 0), False
            # (A tensor found where it was last returns the same Memory: no comparison.)
            known = pointers[name]
            if memory is not known and memory != known:
                status = self._lib.ws_agent_set_tensor_data(self._handle, name.encode(),
                                                            ctypes.c_void_p(memory.pointer or None), memory.nbytes)
                if status != 0:
                    raise from_status(status, _native.text(self._lib.ws_agent_error(self._handle)),
                                      "set_tensor_data")
                pointers[name] = memory
        return found

    def publish(self, step: Optional[int] = None, generate: Optional[Mapping[str, Any]] = None) -> Publication:
        """Joins the collective publication of trainer step `step` (every rank the same; None
        lets the host number it). Returns when the rollout runtime committed the new weights
        (or raises WsyncError, with the same text on every rank: nothing was committed), and
        the recipe's schedule steps after "publish" ran.

        `generate` ({"prompts": [[token ids]], "sampling": {...}}, sampling the same on every
        rank that asks) is what the schedule's "generate" step generates for this rank with
        the weights just published, between the schedule's memory steps (the trainer's
        offloads, the KV cache woken before it; the sleep and onloads after it): one call is
        the whole switch from training to generation and back. Its outputs come back as the
        Publication's ``generation``. A schedule with no "generate" after "publish" refuses it."""
        handle = self._checked("publish")
        self._synchronize()
        self._refresh()
        result = _native.PublishResult()
        request = None if generate is None else json.dumps(dict(generate)).encode()
        self._run("publish", self._lib.ws_agent_publish_generate, handle, -1 if step is None else int(step),
                  request, ctypes.byref(result))
        text = _native.text(self._lib.ws_agent_report(handle))
        report = json.loads(text) if text else {}
        timings = report.get("timings") or {}
        generated = _native.text(self._lib.ws_agent_generation(handle))
        return Publication(int(result.model_version), result.publication_id.decode(), result.manifest.decode(),
                           int(result.receipts), bytes=int(report.get("bytes") or 0),
                           seconds=float(timings.get("total") or 0.0), timings=timings, report=report,
                           generation=json.loads(generated) if generated else None)

    def close(self) -> None:
        """Leaves the host, unmaps every buffer the agent mapped; closes the agent's own host.
        Safe to call twice."""
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        self._lib.ws_agent_close(handle)  # only frees it when its host closed first
        if self._own_host:
            self._host.close()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["Agent", "Publication", "WsyncError"]
