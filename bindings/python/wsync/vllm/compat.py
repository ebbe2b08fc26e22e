"""Everything the vllm runtime reads of vLLM and torch beyond vLLM's documented ``LLM`` API,
one function each, named for what it does.

The documented API (``vllm.LLM(...)``, its ``generate``, ``collective_rpc``, ``sleep``,
``wake_up`` and ``reset_prefix_cache``, ``SamplingParams``, ``TokensPrompt``) is used where
it is needed, from the module ``vllm()`` returns. Everything else is here: vLLM's engine
client (whether its EngineCore died, its processes, the outputs it sent), the members of
vLLM's GPU worker that the worker extension (wsync.vllm.worker.extension) reads and calls, the
trainer-side weight-transfer setup, vLLM's parameter names, and the torch internals the
worker reads parameters and rebuilds IPC tensors with. Each function's docstring says
what it reads and the version it was read from. A member that is not there raises
``VllmUnsupported`` naming it and the vLLM version found, rather than answering None; the
few absences vLLM 0.26 itself has (an in-process EngineCore, engines vLLM did not start as
local processes, torch without the subclass switch) are answered as such, each said where.
``tests/python/test_compat.py`` fails when another module of the package reaches past the
documented API.

Supported versions: vLLM ``SUPPORTED_VLLM`` (the releases whose internals these were read
from and that have run; each vLLM release pins its torch, so the vLLM check covers torch
here). ``vllm()`` imports vLLM, the first time the vllm runtime needs it (an engine
starting: importing wsync.vllm imports neither vLLM nor torch), and refuses another
version with ``VllmUnsupported``, naming the version found and the supported range. With
``WSYNC_VLLM_UNSUPPORTED=1`` in the runtime's environment (the host passes its own on) the
refusal is a warning and the runtime goes on, at the user's risk: a member that moved still
fails as it is used, by name.

What an upgrade of vLLM (or its torch) has to check, before widening ``SUPPORTED_VLLM``:

- every function here against the new sources (its docstring names what it reads), then
  their "read from" versions;
- wsync.vllm.worker.wire's ``update_info`` (vLLM's packed IPC format, per version: 0.27+ changes it)
  and ``cuda_ipc_rebuild_args``'s tuple and ``HANDLE_VERSION`` (torch's own, private);
- the documented calls wsync makes with arguments newer than the API's first form:
  ``LLM.sleep(level=0, mode="keep")``, ``LLM.wake_up(tags=["scheduling"])``,
  ``LLM.reset_prefix_cache(reset_running_requests=...)``, ``TokensPrompt(cache_salt=...)``,
  ``collective_rpc(timeout=...)``, and the engine arguments wsync sets
  (wsync.vllm.runtime.engine.FIXED_ARGUMENTS, ``logprobs_mode``);
- the models' parameters (names, fused layouts) against wsync's loader plans (wsync.plan,
  VLLM_NAME_INFIXES): the direct loader's check against vLLM's own loader (``check =
  "first"``) fails naming a parameter that moved;
- then the GPU tier with the new vLLM (tests/gpu/run.sh: vllm_e2e, vllm_faults,
  vllm_keep), both load modes.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
import warnings
from types import ModuleType
from typing import Any, Optional

from .failure import Failure

#: The vLLM releases wsync runs with, as (major, minor) of the lowest and the highest; any
#: patch release of them. Only 0.26 has run (pyproject.toml's ``vllm`` extra pins it too).
SUPPORTED_VLLM = ((0, 26), (0, 26))
#: The vLLM release the internals here were read from, and its torch, which errors name.
READ_FROM = "vLLM 0.26"
READ_FROM_TORCH = "torch 2.11"
#: The environment variable that turns the refusal of another vLLM into a warning.
UNSUPPORTED_VARIABLE = "WSYNC_VLLM_UNSUPPORTED"

#: vLLM's parameter names that differ from the resident names of wsync's loader plans
#: (wsync.plan): (vLLM's infix, the plan's). vLLM 0.26 keeps a MoE layer's expert
#: weights in its runner's ``routed_experts`` module.
VLLM_NAME_INFIXES = ((".experts.routed_experts.", ".experts."),)

#: The multiple to which vLLM 0.26's CUTLASS FP8 linear kernel pads a weight's output width
#: that is not one (kernels/linear/scaled_mm/cutlass.py, process_weights_after_loading: zero
#: rows of the [out, in] storage under the [in, out] view; a router of 8 experts holds 16).
#: The direct loader fills the head of such a parameter (runtime/engine_worker.lua).
FP8_OUTPUT_ALIGNMENT = 16

#: torch's shareable-handle version byte, as torch 2.11 writes and reads it (said to change in
#: torch 2.13: not checked here, where only 2.11 runs).
HANDLE_VERSION = 2
#: The handle type of a plain cudaMalloc block.
HANDLE_TYPE = b"c"
#: The bytes of a cudaIpcMemHandle_t, which torch's shareable handle carries.
IPC_HANDLE_BYTES = 64


class VllmUnsupported(Failure):
    """The vLLM found is not one wsync supports, or lacks a member wsync reads (fatal: the
    runtime cannot serve with it)."""

    def __init__(self, message: str) -> None:
        super().__init__("VLLM_UNSUPPORTED", message, fatal=True)


class UnsupportedVllmWarning(RuntimeWarning):
    """vLLM outside the supported range runs anyway (``WSYNC_VLLM_UNSUPPORTED=1``)."""


# Versions -----------------------------------------------------------------------------


def supported_range() -> str:
    """The supported vLLM releases as a reader sees them: "0.26.x", "0.26.x to 0.28.x"."""
    low, high = (f"{major}.{minor}.x" for major, minor in SUPPORTED_VLLM)
    return low if low == high else f"{low} to {high}"


def check_version(version: str) -> None:
    """Refuses vLLM ``version`` outside SUPPORTED_VLLM with VllmUnsupported, or warns
    (UnsupportedVllmWarning) when $WSYNC_VLLM_UNSUPPORTED is 1."""
    release = re.match(r"(\d+)\.(\d+)", version)
    if release and SUPPORTED_VLLM[0] <= (int(release[1]), int(release[2])) <= SUPPORTED_VLLM[1]:
        return
    unsupported = (f"vLLM {version} is not one wsync supports ({supported_range()}: the releases whose internals "
                   "wsync.vllm.compat was read from and that have run)")
    if os.environ.get(UNSUPPORTED_VARIABLE) == "1":
        warnings.warn(f"{unsupported}; running it anyway ({UNSUPPORTED_VARIABLE}=1)", UnsupportedVllmWarning,
                      stacklevel=3)
        return
    raise VllmUnsupported(f"{unsupported}; install a supported one, or set {UNSUPPORTED_VARIABLE}=1 to run this "
                          "one anyway")


_checked: Optional[ModuleType] = None  # (the vllm module whose version was checked)


def vllm() -> ModuleType:
    """vLLM, imported (15-25 s the first time in a process) and its version checked once
    (check_version): the one way into vLLM for the rest of the package."""
    global _checked
    import vllm as module
    if module is not _checked:
        check_version(str(getattr(module, "__version__", "(no __version__)")))
        _checked = module
    return module


def found_version() -> str:
    """The version of the vLLM in this process, or of the one installed, for messages."""
    module = sys.modules.get("vllm")
    if module is not None:
        return str(getattr(module, "__version__", "(no __version__)"))
    try:
        from importlib.metadata import version
        return version("vllm")
    except Exception:
        return "(not installed)"


def _missing(what: str, read_from: str = READ_FROM, found: Optional[str] = None) -> VllmUnsupported:
    found = found or f"vLLM {found_version()}"
    return VllmUnsupported(f"{what} is not there: wsync reads it as {read_from} has it, and this is {found} "
                           f"(supported: vLLM {supported_range()}; wsync.vllm.compat says what an upgrade has to "
                           "check)")


def _member(owner: Any, name: str, what: str) -> Any:
    """``owner.name``, or VllmUnsupported naming ``what`` when it is not there."""
    try:
        return getattr(owner, name)
    except AttributeError:
        raise _missing(what) from None


def _imported(module: str, name: str) -> Any:
    """``name`` from vLLM's module ``module``, or VllmUnsupported naming it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise _missing(f"{module}.{name}") from None


# The trainer side of vLLM's weight transfer -------------------------------------------


def ipc_weight_transfer_config() -> Any:
    """The ``weight_transfer_config`` argument of ``LLM`` for vLLM's IPC weight transfer:
    ``vllm.config.WeightTransferConfig(backend="ipc")`` (read from vLLM 0.26)."""
    return _imported("vllm.config", "WeightTransferConfig")(backend="ipc")


def init_ipc_weight_transfer(llm: Any) -> None:
    """Makes every worker's IPC weight-transfer engine, which has no init info:
    ``LLM.init_weight_transfer_engine({"init_info": {}})`` (read from vLLM 0.26; 0.28
    changed the trainer-side calls)."""
    _member(llm, "init_weight_transfer_engine", "LLM.init_weight_transfer_engine")({"init_info": {}})


# vLLM's engine and its EngineCore client ----------------------------------------------


def _llm_engine(llm: Any) -> Any:
    return _member(llm, "llm_engine", "LLM.llm_engine")


def engine_core_client(llm: Any) -> Any:
    """The client of an LLM's EngineCore: ``LLM.llm_engine.engine_core`` (read from vLLM
    0.26: a SyncMPClient, or an InprocClient with VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return _member(_llm_engine(llm), "engine_core", "LLM.llm_engine.engine_core")


def _process_client(llm: Any) -> Any:
    """The EngineCore client when its EngineCore runs in processes of its own (an
    MPClient, read from vLLM 0.26), or None for one that runs it in this process."""
    client = engine_core_client(llm)
    return client if isinstance(client, _imported("vllm.v1.engine.core_client", "MPClient")) else None


def _resources(client: Any) -> Any:
    return _member(client, "resources", "LLM.llm_engine.engine_core.resources")


def engine_core_pids(llm: Any) -> list[int]:
    """The pids of an LLM's EngineCore processes: its client's engine manager's
    ``processes`` (``MPClient.resources.engine_manager``, a CoreEngineProcManager; read
    from vLLM 0.26). Empty where vLLM started none here: an EngineCore in this process, no
    engine manager (engines started elsewhere) or Ray's actors."""
    client = _process_client(llm)
    if client is None:
        return []
    manager = _member(_resources(client), "engine_manager", "LLM.llm_engine.engine_core.resources.engine_manager")
    if not isinstance(manager, _imported("vllm.v1.engine.utils", "CoreEngineProcManager")):
        return []
    processes = _member(manager, "processes", "LLM.llm_engine.engine_core.resources.engine_manager.processes")
    return [process.pid for process in processes]


def engine_dead(llm: Any) -> bool:
    """Whether vLLM's client saw its EngineCore die: ``MPClient.resources.engine_dead``
    (read from vLLM 0.26). False for an EngineCore in this process."""
    client = _process_client(llm)
    if client is None:
        return False
    return bool(_member(_resources(client), "engine_dead", "LLM.llm_engine.engine_core.resources.engine_dead"))


def pending_outputs(llm: Any) -> bool:
    """Whether outputs the EngineCore sent wait in this process, unread by a step: the
    client's ``outputs_queue`` is not empty (SyncMPClient's, read from vLLM 0.26). False for
    an EngineCore in this process, whose step produces its outputs as it runs."""
    client = _process_client(llm)
    if client is None:
        return False
    return not _member(client, "outputs_queue", "LLM.llm_engine.engine_core.outputs_queue").empty()


def shutdown_engine_core(llm: Any) -> None:
    """Ends an LLM's EngineCore and its workers: its client's ``shutdown()`` (read from
    vLLM 0.26)."""
    _member(engine_core_client(llm), "shutdown", "LLM.llm_engine.engine_core.shutdown")()


def add_request(llm: Any, request_id: str, prompt: Any, params: Any) -> None:
    """Queues a request without waiting for its outputs (engine_step brings them):
    ``LLM.llm_engine.add_request(request_id, prompt, params)`` (LLMEngine's, read from
    vLLM 0.26)."""
    _member(_llm_engine(llm), "add_request", "LLM.llm_engine.add_request")(request_id, prompt, params)


def engine_step(llm: Any) -> list[Any]:
    """One step of vLLM's engine loop; the RequestOutputs it produced:
    ``LLM.llm_engine.step()`` (read from vLLM 0.26)."""
    return _member(_llm_engine(llm), "step", "LLM.llm_engine.step")()


def abort_requests(llm: Any, request_ids: list[str]) -> None:
    """Ends the requests ``request_ids``: ``LLM.llm_engine.abort_request(request_ids)``
    (read from vLLM 0.26)."""
    _member(_llm_engine(llm), "abort_request", "LLM.llm_engine.abort_request")(request_ids)


def delta_output_kind() -> Any:
    """The ``output_kind`` of SamplingParams whose outputs carry only what is new since
    the last step: ``vllm.sampling_params.RequestOutputKind.DELTA`` (read from vLLM 0.26)."""
    return _member(_imported("vllm.sampling_params", "RequestOutputKind"), "DELTA",
                   "vllm.sampling_params.RequestOutputKind.DELTA")


# vLLM's GPU worker (``self`` of the worker extension) ---------------------------------


def worker_device(worker: Any) -> Any:
    """The torch.device of a worker's GPU: ``Worker.device`` (read from vLLM 0.26)."""
    return _member(worker, "device", "the vLLM worker's device")


def worker_rank(worker: Any) -> int:
    """A worker's rank: ``Worker.rank`` (read from vLLM 0.26: the global rank, which is the
    TP rank while TP is the only parallelism)."""
    return int(_member(worker, "rank", "the vLLM worker's rank"))


def tensor_parallel_size(worker: Any) -> int:
    """The TP world a worker belongs to: ``Worker.parallel_config.tensor_parallel_size``
    (read from vLLM 0.26)."""
    config = _member(worker, "parallel_config", "the vLLM worker's parallel_config")
    return int(_member(config, "tensor_parallel_size", "the vLLM worker's parallel_config.tensor_parallel_size"))


def worker_model(worker: Any) -> Any:
    """The torch module a worker serves, as it is now: ``Worker.get_model()`` (read from
    vLLM 0.26)."""
    return _member(worker, "get_model", "the vLLM worker's get_model")()


def start_weight_update(worker: Any) -> None:
    """Opens a weight update in a worker's weight-transfer engine:
    ``Worker.start_weight_update()`` (read from vLLM 0.26)."""
    _member(worker, "start_weight_update", "the vLLM worker's start_weight_update")()


def update_weights(worker: Any, update_info: dict[str, Any]) -> None:
    """Loads one chunk of the open update (``update_info``: wsync.vllm.worker.wire's):
    ``Worker.update_weights(update_info)`` (read from vLLM 0.26)."""
    _member(worker, "update_weights", "the vLLM worker's update_weights")(update_info)


def finish_weight_update(worker: Any) -> None:
    """Ends the open weight update: ``Worker.finish_weight_update()`` (read from vLLM
    0.26)."""
    _member(worker, "finish_weight_update", "the vLLM worker's finish_weight_update")()


def load_weights(model: Any, weights: list[tuple[str, Any]]) -> None:
    """Loads ``(name, tensor)`` pairs of canonical tensors with the model's own loader:
    the vLLM model's ``load_weights`` (read from vLLM 0.26)."""
    _member(model, "load_weights", "the vLLM model's load_weights")(weights)


def quiet_layerwise_reload() -> Any:
    """A context in which vLLM's layerwise reload logs only its errors: its finalize warns
    "Failed to load weights" for every module that got no weights
    (``finalize_layerwise_processing``, model_executor/model_loader/reload/layerwise.py:257-269
    of vLLM 0.26), and the direct loader's FP8 check reloads a few modules at a time, leaving
    out the others by design. The reload logs through its module's logger (``init_logger(__name__)``,
    layerwise.py:32)."""
    import logging
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")

    @contextlib.contextmanager
    def quiet() -> Any:
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            logger.setLevel(level)
    return quiet()


def repoint_moe_scales(model: Any) -> int:
    """Points each online-FP8 MoE layer's kernel configuration back at the layer's own scale
    Parameters, after a vLLM layerwise reload (FP8.md, hazard H1); the number of layers
    re-pointed. The reload runs the quant method's ``_setup_kernel`` on temporary tensors,
    which builds ``quant_method.moe_quant_config`` over the temporary scales
    (model_executor/layers/quantization/online/fp8.py:447-462), then copies the result into
    the layer's original Parameters and registers those again (reload/layerwise.py:395-411);
    the experts read ``w1_scale``/``w2_scale`` from that config (fused_moe/config.py:334-359,
    fused_moe/modular_kernel.py:715-720; the kernel's experts hold the same config object,
    fused_moe/oracle/fp8.py:671-709), so later in-place writes to the layer's scales would
    miss the eager path. Sets ``moe_quant_config._w1.scale`` and ``._w2.scale`` (dataclass
    fields, config.py:174-252) to ``layer.w13_<weight_scale_name>`` and
    ``layer.w2_<weight_scale_name>`` (``_Fp8OnlineMoEBase.weight_scale_name``, online/fp8.py:396;
    read from vLLM 0.26)."""
    repointed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        config = getattr(method, "moe_quant_config", None)
        scale_name = getattr(method, "weight_scale_name", None)
        if config is None or scale_name is None:
            continue
        w13_scale = getattr(module, f"w13_{scale_name}", None)
        w2_scale = getattr(module, f"w2_{scale_name}", None)
        if w13_scale is None or w2_scale is None:
            continue
        _member(config, "_w1", "FusedMoEQuantConfig._w1").scale = w13_scale
        _member(config, "_w2", "FusedMoEQuantConfig._w2").scale = w2_scale
        repointed += 1
    return repointed


def resident_name(vllm_name: str) -> str:
    """The loader plan's name for vLLM's parameter ``vllm_name`` (VLLM_NAME_INFIXES)."""
    for theirs, ours in VLLM_NAME_INFIXES:
        vllm_name = vllm_name.replace(theirs, ours)
    return vllm_name


# torch --------------------------------------------------------------------------------


def plain_parameters() -> Any:
    """A context in which reading a parameter (its pointer, shape, dtype, ``.data``) skips
    its subclass's ``__torch_function__``. vLLM 0.26's linear layers' parameters
    (``BasevLLMParameter``) define one in Python, so every such read of them costs
    microseconds: the fingerprint's three reads of a 30B-A3B's 190 such parameters took
    1.7 ms a publication on the H200, 0.06 ms with it off. torch 2.11's
    ``torch._C.DisableTorchFunctionSubclass``; without it, a context that changes nothing
    (it saves time, nothing depends on it)."""
    import torch
    off = getattr(torch._C, "DisableTorchFunctionSubclass", None)
    return off() if off is not None else contextlib.nullcontext()


def parameter_dicts(model: Any) -> list[dict[str, Any]]:
    """The dict each module of a torch module holds its own parameters in, by name (None
    for one registered empty): every ``module._parameters`` of ``model.modules()`` (read
    from torch 2.11). Looking a parameter up in its holder sees it replaced without walking
    the module tree again."""
    try:
        return [module._parameters for module in model.modules()]
    except AttributeError:
        torch = sys.modules.get("torch")
        raise _missing("torch.nn.Module._parameters", READ_FROM_TORCH,
                       f"torch {getattr(torch, '__version__', '(not imported)')}") from None


def storage_handle(ipc_handle: bytes) -> bytes:
    """The storage handle torch's CUDA caching allocator shares: version, type, handle
    (read from torch 2.11)."""
    if len(ipc_handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"a cudaIpcMemHandle_t is {IPC_HANDLE_BYTES} bytes, not {len(ipc_handle)}")
    return bytes([HANDLE_VERSION]) + HANDLE_TYPE + ipc_handle


def cuda_ipc_rebuild_args(torch: Any, ipc_handle: bytes, storage_bytes: int, offset: int, nbytes: int,
                          ref_counter: bytes) -> tuple:
    """torch's ``rebuild_cuda_tensor`` arguments (torch.multiprocessing.reductions, read
    from torch 2.11) for ``nbytes`` uint8 elements from byte ``offset`` of a whole exported
    buffer. The device index (6) is the consumer's to set. The producer synchronized before
    sending: no event to wait on. ``ref_counter`` names a shared-memory file the consumer
    decrements when it lets go (best effort in torch: a missing file is ignored)."""
    return (torch.Tensor, torch.Size([nbytes]), (1,), offset, torch.storage.TypedStorage, torch.uint8, 0,
            storage_handle(ipc_handle), storage_bytes, 0, False, ref_counter, 0, b"", False)
