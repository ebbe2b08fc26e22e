"""wsync's worker extension for vLLM (``LLM(worker_extension_cls="wsync.vllm.worker.extension.WorkerExtension")``).

vLLM mixes this class into each of its TP workers; the vllm runtime's main process calls it
through ``LLM.collective_rpc`` (wsync.vllm.runtime.engine). Each worker answers for itself: its rank,
its physical GPU's UUID, and the weight commands of a publication, the same commands and
payloads as a TP worker of the reference runtime (init_weights, start_update, load_chunk,
finish_update), each worker taking its own rank's packed buffers from the payload.

Two load modes:

- ``native``: each chunk goes through vLLM's own packed IPC path: this worker builds vLLM
  0.26's ``update_info`` for the chunk (wsync.vllm.worker.wire) and calls the worker's own
  ``update_weights``, so vLLM's IPCWeightTransferEngine parses it and vLLM's loader writes the
  parameters; ``start_weight_update`` / ``finish_weight_update`` bracket the publication.
- ``direct``: the chunk is copied straight from the packed buffer into the resident
  parameters by wsync's loader (the reference worker's, scripts/wsync/runtime/loader.lua,
  running in libwsync inside this process over vLLM's parameter memory through
  scripts/wsync/runtime/engine_worker.lua): one batched copy per chunk, planned once per
  session.

Either way the receipt is built here, from what this worker loaded: the publication id and
version, the TP rank and world, the GPU UUID, the manifest of the loaded tensors' records
and the number of resident parameters filled.
"""
from __future__ import annotations

import json
import os
import time
import traceback
from typing import Any, Callable, Optional

from ...errors import WsyncError
from ...manifest import Manifest
from .. import compat
from .receipts import receipt
from ..failure import Failure


class LoaderPlan:
    """This rank's loader plan from libwsync (wsync.plan's family module): the resident
    parameters it fills and, per canonical tensor, which of them it writes."""

    def __init__(self, host: Any, family: str, config: dict[str, Any], world: int, rank: int,
                 quantization: Optional[str] = None) -> None:
        extra = {"quantization": quantization} if quantization is not None else {}
        answer = host.call("loader_plan", result_bytes=256 << 20, family=family, config=config, world=int(world),
                           rank=int(rank), **extra)
        self.residents = [{"name": name, "dtype": dtype, "shape": shape, "bytes": nbytes}
                          for name, dtype, shape, nbytes in answer["residents"]]
        self.writes: dict[str, list[str]] = answer["writes"]


class _Native:
    """Loads through vLLM's own packed IPC update (see the module's doc)."""

    mode = "native"

    def __init__(self, worker: Any, identity: dict[str, Any], host: Any) -> None:
        self.worker, self.identity, self.host = worker, identity, host
        self.chunks: dict[int, list[dict[str, Any]]] = {}
        self.update: Optional[dict[str, Any]] = None
        self.ref_counter = f"/wsync-{os.getpid()}-no-refcount".encode()

    def init_weights(self, payload: dict[str, Any]) -> dict[str, Any]:
        rank = self.identity["rank"]
        self.descriptors = payload["buffers"][rank]
        self.plan = LoaderPlan(self.host, payload["family"], payload["config"], payload["tp"], rank,
                               payload.get("quantization"))
        self.chunks = {}
        return {"rank": rank, "resident_tensors": len(self.plan.residents), "buffers": len(self.descriptors)}

    def start_update(self, payload: dict[str, Any]) -> dict[str, Any]:
        compat.start_weight_update(self.worker)
        self.update = {"header": payload["header"], "loaded": [], "touched": set(), "tensors": 0, "bytes": 0}
        return {}

    def load_chunk(self, payload: dict[str, Any]) -> dict[str, Any]:
        import torch
        from . import wire
        update = self.update
        if update is None:
            raise Failure("NOT_UPDATING", "load_chunk outside start_update/finish_update", fatal=True)
        k = payload["chunk"]
        if payload.get("tensors") is not None:
            self.chunks[k] = payload["tensors"]
        tensors = self.chunks.get(k)
        if tensors is None:
            raise Failure("BAD_METADATA", f"chunk {k} comes without tensor metadata, and none came before", fatal=True)
        slot = payload["buffer"]
        if not isinstance(slot, int) or not 1 <= slot <= len(self.descriptors):
            raise Failure("NO_BUFFER", f"load_chunk names buffer {slot}; {len(self.descriptors)} are mapped", fatal=True)
        started = time.perf_counter()
        for run in wire.runs(tensors):
            info = wire.update_info_v026(torch, run, self.identity["device"]["uuid"], self.descriptors[slot - 1],
                                         self.ref_counter)
            compat.update_weights(self.worker, info)
        torch.cuda.synchronize(compat.worker_device(self.worker))
        seconds = time.perf_counter() - started
        for tensor in tensors:
            # (A canonical tensor may fill nothing on this TP rank: a vocabulary
            # shorter than the ranks' padded rows. vLLM's loader refuses a name
            # the model does not have.)
            update["touched"].update(self.plan.writes.get(tensor["name"], ()))
        update["loaded"].append(k)
        update["tensors"] += len(tensors)
        nbytes = sum(tensor["bytes"] for tensor in tensors)
        update["bytes"] += nbytes
        return {"rank": self.identity["rank"], "tensors": len(tensors), "bytes": nbytes, "copy_seconds": seconds}

    def finish_update(self, payload: dict[str, Any]) -> dict[str, Any]:
        update = self.update
        if update is None:
            raise Failure("NOT_UPDATING", "finish_update without start_update", fatal=True)
        header = update["header"]
        if payload.get("publication_id") != header["publication_id"]:
            raise Failure("WRONG_PUBLICATION", f"finish_update for publication {payload.get('publication_id')}; this "
                          f"worker is updating {header['publication_id']}", fatal=True)
        self.update = None
        compat.finish_weight_update(self.worker)
        import torch
        # (vLLM's layerwise reload materializes each module's weights anew and frees them to
        # torch's cache, which the model of memory does not count: the likely cause of the
        # 6.5 GiB over it after a native FP8 update of the 30B-A3B on the H200.)
        torch.cuda.empty_cache()
        manifest = Manifest()
        for k in update["loaded"]:
            for tensor in self.chunks[k]:
                manifest.add(tensor["name"], tensor["dtype"], tensor["shape"])
        return receipt(header, self.identity["rank"], self.identity["device"]["uuid"], manifest.hexdigest(),
                       update["tensors"], update["bytes"], len(update["touched"]))


class DirectLoader:
    """Loads with wsync's loader inside this process (see the module's doc): the commands go
    to the engine worker of scripts/wsync/runtime/engine_worker.lua in ``host`` (a wsync.Host),
    over the engine's parameters, which ``residents()`` lists where they lie now: name ->
    {pointer, size, dtype, shape}. With ``fingerprint`` (a cheap value that changes when any
    parameter moves, is replaced or changes shape or dtype), a publication whose fingerprint is
    the one bound last tells the loader its parameters are where they were instead of listing
    them again."""

    mode = "direct"

    def __init__(self, identity: dict[str, Any], host: Any,
                 residents: Callable[[], dict[str, dict[str, Any]]],
                 fingerprint: Optional[Callable[[], Any]] = None) -> None:
        self.identity, self.host, self.residents, self.fingerprint = identity, host, residents, fingerprint
        self.opened = False
        self.bound: Any = None  # (the fingerprint of the parameters the loader holds, when known)

    def _call(self, cmd: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            result = self.host.call("worker_command", result_bytes=16 << 20, cmd=cmd, payload=payload)
        except WsyncError as failed:
            if failed.code is None:
                raise  # (not a refusal of wsync's: a bug, with its traceback)
            raise Failure(failed.code, str(failed.fields.get("message", failed.text)),
                          fatal=failed.fields.get("fatal") is not False, rank=self.identity["rank"]) from None
        return result or {}

    def init_weights(self, payload: dict[str, Any]) -> dict[str, Any]:
        if not self.opened:
            device = self.identity["device"]
            self._call("open", {"rank": self.identity["rank"], "world": self.identity["world"],
                                "backend": device["backend"], "device": device["index"]})
            self.opened = True
        # (Each worker maps its own rank's buffers, as the reference runtime's do.)
        self.bound = None
        key = self.fingerprint() if self.fingerprint else None
        rank = self.identity["rank"]
        own = dict(payload, buffers=payload["buffers"][rank], residents=self.residents())
        if payload.get("quantization") == "fp8":
            own["output_alignment"] = compat.FP8_OUTPUT_ALIGNMENT  # (an FP8 weight vLLM holds padded)
        own.pop("gates", None)
        if payload.get("gates") is not None:
            own["gate"] = payload["gates"][rank]  # (chunks ordered on the device: this rank's gate)
        result = self._call("init_weights", own)
        self.bound = key
        return result

    def start_update(self, payload: dict[str, Any]) -> dict[str, Any]:
        # (vLLM's sleep mode keeps a parameter's address through sleep and wake;
        # the loader re-plans the chunks when one moved.)
        started = time.perf_counter()
        key = self.fingerprint() if self.fingerprint else None
        fingerprinted = time.perf_counter()
        if key is not None and key == self.bound:
            payload = dict(payload, residents_unchanged=True)
        else:
            self.bound = None
            payload = dict(payload, residents=self.residents())
        listed = time.perf_counter()
        result = self._call("start_update", payload)
        self.bound = key
        # (For the runtime's timing summary: where a start's time goes.)
        self.parts = {"fingerprint": fingerprinted - started, "residents": listed - fingerprinted,
                      "loader": time.perf_counter() - listed}
        return result

    def load_chunk(self, payload: dict[str, Any]) -> dict[str, Any]:
        return self._call("load_chunk", payload)

    def finish_update(self, payload: dict[str, Any]) -> dict[str, Any]:
        return self._call("finish_update", payload)

    def resident_values(self, payload: dict[str, Any]) -> dict[str, Any]:
        return self._call("resident_values", payload)

    def close(self) -> None:
        if self.opened:
            self._call("close", {})
            self.opened = False


#: The parameters one step of the check against vLLM's loader clones at most (bytes).
CHECK_GROUP_BYTES = 2 << 30


def check_groups(tensors: list[dict[str, Any]], writes: dict[str, list[str]], size: Callable[[str], int],
                 limit: int) -> list[tuple[list[dict[str, Any]], set[str]]]:
    """A chunk's canonical tensors in order, in groups whose resident parameters (what
    ``writes`` says each fills; ``size`` their bytes) come to ``limit`` bytes at most, or
    to one tensor's when a single tensor's exceed it: each group with its parameters. The
    check against vLLM's loader clones a group's parameters at a time."""
    groups: list[tuple[list[dict[str, Any]], set[str]]] = []
    group: list[dict[str, Any]] = []
    residents: set[str] = set()
    total = 0  # (the bytes of `residents`, kept as they grow)
    for tensor in tensors:
        new = set(writes.get(tensor["name"], ())) - residents
        if group and total + sum(size(name) for name in new) > limit:
            groups.append((group, residents))
            group, residents, total = [], set(), 0
            new = set(writes.get(tensor["name"], ()))
        group.append(tensor)
        residents |= new
        total += sum(size(name) for name in new)
    if group:
        groups.append((group, residents))
    return groups


def reload_units(writes: dict[str, list[str]]) -> dict[str, set[str]]:
    """The canonical tensors of a quantized loader plan (``writes``: each tensor's resident
    parameters) in the units the check against vLLM's FP8 loader reloads, each unit by
    every one of its tensors: the tensors that fill parameters of one module (a resident's
    name up to its last dot), joined through any tensor that fills two. vLLM's layerwise
    reload quantizes a module only once all of it is loaded, and fills what a module did
    not get with uninitialized memory (FP8.md, section 7), so the check reloads whole
    modules. A tensor that fills nothing on this rank belongs to no unit."""
    owner: dict[str, str] = {}  # (a module's representative, toward the root)

    def root(module: str) -> str:
        while owner.setdefault(module, module) != module:
            owner[module] = owner[owner[module]]
            module = owner[module]
        return module
    for residents in writes.values():
        modules = [root(name.rsplit(".", 1)[0]) for name in residents]
        for module in modules[1:]:
            owner[root(module)] = root(modules[0])
    units: dict[str, set[str]] = {}
    for tensor, residents in writes.items():
        if residents:
            units.setdefault(root(residents[0].rsplit(".", 1)[0]), set()).add(tensor)
    return {tensor: unit for unit in units.values() for tensor in unit}


class _CudaBytes:
    """Device bytes as torch.as_tensor takes them (``__cuda_array_interface__``)."""

    def __init__(self, pointer: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (pointer, False),
                                         "version": 3}


class CheckedDirectLoader(DirectLoader):
    """The direct loader inside a vLLM worker, checked against vLLM's own loader: in the
    publications ``check`` says ("first" of a session, "every", "never"), each chunk, once
    copied by the direct loader, is loaded again by the model's own ``load_weights`` from
    the same bytes of the packed buffer, and every parameter the chunk touched must then be
    bitwise what the direct loader wrote. Any difference fails the publication (fatal),
    naming the parameter and where it first differs: ``load = "native"`` serves such a
    model.

    Under a quantization (FP8), vLLM's own path from bfloat16 is its layerwise reload, which
    quantizes a module once all of it is loaded: each module's tensors wait (views of the
    packed buffer, cloned when the chunk ends before the module does) until the last of them
    arrives, and then the module is reloaded by vLLM alone, between its
    ``start_weight_update`` and ``finish_weight_update``, a bounded group of modules at a
    time (FP8.md, section 7)."""

    def __init__(self, worker: Any, identity: dict[str, Any], host: Any) -> None:
        super().__init__(identity, host, lambda: torch_residents(compat.worker_model(worker)),
                         TorchFingerprint(lambda: compat.worker_model(worker)))
        self.worker = worker
        self.check, self.checked, self.checking = "first", False, False
        self.chunks: dict[int, list[dict[str, Any]]] = {}
        self.units: Optional[dict[str, set[str]]] = None  # (under a quantization: reload_units)
        self.waiting: dict[str, Any] = {}  # (a quantized check's tensors whose modules are not all here yet)

    def init_weights(self, payload: dict[str, Any]) -> dict[str, Any]:
        result = super().init_weights(payload)
        self.check = payload.get("check", "first")
        self.plan = LoaderPlan(self.host, payload["family"], payload["config"], payload["tp"], self.identity["rank"],
                               payload.get("quantization"))
        self.units = reload_units(self.plan.writes) if payload.get("quantization") is not None else None
        self.chunks, self.checked, self.waiting = {}, False, {}
        return result

    def start_update(self, payload: dict[str, Any]) -> dict[str, Any]:
        self.checking = self.check == "every" or (self.check == "first" and not self.checked)
        self.waiting = {}
        return super().start_update(payload)

    def load_chunk(self, payload: dict[str, Any]) -> dict[str, Any]:
        if payload.get("tensors") is not None:
            self.chunks[payload["chunk"]] = payload["tensors"]
        result = super().load_chunk(payload)
        if self.checking:
            started = time.perf_counter()
            if self.units is None:
                self._check_chunk(payload["chunk"], payload["buffer"])
            else:
                self._check_quantized_chunk(payload["chunk"], payload["buffer"])
            result["check_seconds"] = time.perf_counter() - started
        return result

    def finish_update(self, payload: dict[str, Any]) -> dict[str, Any]:
        result = super().finish_update(payload)
        if self.checking:
            self.checked = True
            result["checked_against_vllm"] = True
            if self.waiting:
                # (A publication that left out part of a module: vLLM cannot reload it alone.)
                result["unchecked_tensors"] = len(self.waiting)
            self.waiting = {}
            import torch
            torch.cuda.empty_cache()  # (the check's copies, out of torch's cache: the model of memory has none)
        return result

    def _memories(self, tensors: list[dict[str, Any]], slot: int) -> dict[int, Any]:
        """The packed buffers (or, on the direct path from the trainer's own storage, the
        memories each tensor names) a chunk's tensors lie in, as byte tensors."""
        import torch
        device = compat.worker_device(self.worker)
        memories: dict[int, Any] = {}
        for tensor in tensors:
            where = int(tensor.get("buffer", slot))
            if where not in memories:
                region = self._call("mapped", {"buffer": where})
                memories[where] = torch.as_tensor(_CudaBytes(int(region["pointer"]), int(region["size"])),
                                                  device=device)
        return memories

    @staticmethod
    def _view(tensor: dict[str, Any], memories: dict[int, Any], slot: int) -> Any:
        import torch
        memory = memories[int(tensor.get("buffer", slot))]
        return memory[tensor["offset"]:tensor["offset"] + tensor["bytes"]].view(getattr(torch, tensor["dtype"])) \
            .view(tensor["shape"])

    def _check_chunk(self, chunk: int, slot: int) -> None:
        tensors = self.chunks[chunk]
        memories = self._memories(tensors, slot)
        model = compat.worker_model(self.worker)
        parameters = {compat.resident_name(name): parameter for name, parameter in model.named_parameters()}

        def size(name: str) -> int:
            return parameters[name].data.numel() * parameters[name].data.element_size()
        for group, residents in check_groups(tensors, self.plan.writes, size, CHECK_GROUP_BYTES):
            direct = {name: parameters[name].data.clone() for name in residents}
            compat.load_weights(model, [(tensor["name"], self._view(tensor, memories, slot)) for tensor in group])
            self._compare(chunk, direct, parameters, "vLLM's own loader")

    def _check_quantized_chunk(self, chunk: int, slot: int) -> None:
        assert self.units is not None
        tensors = [tensor for tensor in self.chunks[chunk] if tensor["name"] in self.units]
        memories = self._memories(tensors, slot)
        for tensor in tensors:
            self.waiting[tensor["name"]] = self._view(tensor, memories, slot)
        order = {name: at for at, name in enumerate(self.waiting)}
        ready: dict[str, list[str]] = {}  # (the units complete now, by their first tensor, in the order they came)
        for tensor in tensors:
            unit = self.units[tensor["name"]]
            if unit <= order.keys():
                names = sorted(unit, key=order.__getitem__)
                ready[names[0]] = names
        if ready:
            model = compat.worker_model(self.worker)
            parameters = {compat.resident_name(name): parameter for name, parameter in model.named_parameters()}

            def size(name: str) -> int:
                return parameters[name].data.numel() * parameters[name].data.element_size()
            # (Grouped a unit at a time: a group never holds part of a module.)
            writes = {first: sorted({resident for name in names for resident in self.plan.writes[name]})
                      for first, names in ready.items()}
            for group, residents in check_groups([{"name": first} for first in ready], writes, size,
                                                 CHECK_GROUP_BYTES):
                self._reload_and_compare(chunk, [(name, self.waiting.pop(name)) for unit in group
                                                 for name in ready[unit["name"]]], residents, model)
        for tensor in tensors:  # (what waits past this chunk cannot stay in its buffer)
            if tensor["name"] in self.waiting:
                self.waiting[tensor["name"]] = self.waiting[tensor["name"]].clone()

    def _reload_and_compare(self, chunk: int, weights: list[tuple[str, Any]], residents: set[str],
                            model: Any) -> None:
        """Reloads whole modules' bfloat16 ``weights`` through vLLM's layerwise reload (which
        quantizes them and copies the result into the live parameters, putting every module
        that got no weights back as it was, reload/layerwise.py:257-269), then compares
        ``residents`` with what the direct loader wrote there."""
        parameters = {compat.resident_name(name): parameter for name, parameter in model.named_parameters()}
        direct = {name: parameters[name].data.clone() for name in residents}
        with compat.quiet_layerwise_reload():
            compat.start_weight_update(self.worker)
            try:
                compat.load_weights(model, weights)
            finally:
                compat.finish_weight_update(self.worker)
        compat.repoint_moe_scales(model)
        parameters = {compat.resident_name(name): parameter for name, parameter in model.named_parameters()}
        self._compare(chunk, direct, parameters, "vLLM's own FP8 loader (its layerwise reload)")

    def _compare(self, chunk: int, direct: dict[str, Any], parameters: dict[str, Any], whose: str) -> None:
        """Fails DIRECT_PLAN_MISMATCH at the first parameter of ``direct`` (the direct
        loader's bytes, cloned) that ``parameters`` do not hold bitwise."""
        import torch
        device = compat.worker_device(self.worker)
        if getattr(device, "type", None) == "cuda":
            torch.cuda.synchronize(device)
        shapes = {resident["name"]: resident["shape"] for resident in self.plan.residents}
        for name in sorted(direct):
            own, ours = parameters[name].data, direct[name]
            shape = shapes.get(name)
            if shape is not None and list(own.shape) != list(shape) and len(own.shape) == len(shape):
                # (A parameter the engine holds padded, the plan's part at the head of each dim:
                # the padding is the engine's own, reaches no output, and is not the plan's.)
                part = tuple(slice(0, int(size)) for size in shape)
                own, ours = own[part], ours[part]
            dims, width = list(own.shape), own.element_size()
            own = own.reshape(-1).view(torch.uint8)
            ours = ours.reshape(-1).view(torch.uint8)
            if not torch.equal(own, ours):
                differ = own != ours
                first = int(differ.nonzero()[0])
                where = [int(index) for index in torch.unravel_index(torch.tensor(first // width), dims)]
                element = slice(first - first % width, first - first % width + width)
                raise Failure("DIRECT_PLAN_MISMATCH", f"chunk {chunk}: {whose} writes {name} differently from wsync's "
                              f"direct loader (first at byte {first} of {own.numel()}, element {where} of {dims}: "
                              f"{bytes(own[element].tolist()).hex()} against wsync's "
                              f"{bytes(ours[element].tolist()).hex()}; {int(differ.sum())} bytes differ); "
                              "load = \"native\" serves this model", fatal=True, rank=self.identity["rank"])


def torch_residents(model: Any) -> dict[str, dict[str, Any]]:
    """A torch module's parameters as the direct loader takes them, by the loader plan's
    names, each with its strides (in elements): the loader writes rows of bytes, so each must
    be contiguous, or the transposed view of contiguous storage that vLLM's FP8 linear
    weights are (float8 [in, out] over row-major [out, in]; the loader plan says which, and
    wsync's loader refuses strides other than the plan's)."""
    with compat.plain_parameters():
        return _torch_residents(model)


def _torch_residents(model: Any) -> dict[str, dict[str, Any]]:
    found = {}
    for vllm_name, parameter in model.named_parameters():
        name = compat.resident_name(vllm_name)
        data = parameter.data
        if not data.is_contiguous() and not (data.dim() == 2 and data.t().is_contiguous()):
            raise Failure("DIRECT_UNSUPPORTED", f"vLLM's parameter {vllm_name} is neither contiguous nor the "
                          "transpose of contiguous storage; load = \"native\" serves this model", fatal=True)
        found[name] = {"pointer": data.data_ptr(), "size": data.numel() * data.element_size(),
                       "dtype": str(data.dtype).split(".")[-1], "shape": list(data.shape),
                       "stride": list(data.stride())}
    return found


class TorchFingerprint:
    """A value that changes when any parameter of the torch module ``model_of()`` moves, is
    replaced, or changes shape or dtype (the direct loader's test that vLLM's parameters lie
    where they were bound). Each call looks at the parameters seen last, through the dicts
    that hold them, without walking the module tree again (the walk over a 30B-A3B model's
    thousands of modules took milliseconds a publication); it walks again, and the value
    changes, when one moved or the model is another."""

    def __init__(self, model_of: Callable[[], Any]) -> None:
        self.model_of = model_of
        self.model: Any = None
        self.seen: list[tuple[dict[str, Any], str, Any, int, Any, Any]] = []
        self.value = 0

    def _unchanged(self, model: Any) -> bool:
        if model is not self.model:
            return False
        for holder, name, parameter, pointer, shape, dtype in self.seen:
            if holder.get(name) is not parameter or parameter.data_ptr() != pointer or parameter.shape != shape \
                    or parameter.dtype != dtype:
                return False
        return True

    def __call__(self) -> int:
        model = self.model_of()
        with compat.plain_parameters():
            if self.seen and self._unchanged(model):
                return self.value
            self.model, self.value = model, self.value + 1
            self.seen = [(holder, name, parameter, parameter.data_ptr(), parameter.shape, parameter.dtype)
                         for holder in compat.parameter_dicts(model) for name, parameter in holder.items()
                         if parameter is not None]
        return self.value


class WorkerExtension:
    """Mixed into vLLM's GPU worker (``self`` is the worker). Every method name starts with
    ``wsync_``, so none collides with the worker's own."""

    def wsync_identity(self) -> dict[str, Any]:
        """This TP worker: rank, world, pid, device (index and torch-style UUID) and the
        count of its resident parameters."""
        import torch
        index = compat.worker_device(self).index
        return {
            "rank": compat.worker_rank(self), "world": compat.tensor_parallel_size(self), "pid": os.getpid(),
            "device": {"backend": "cuda", "index": index, "uuid": str(torch.cuda.get_device_properties(index).uuid)},
            "resident_tensors": sum(1 for _ in compat.worker_model(self).named_parameters()),
        }

    def wsync_release_cache(self) -> None:
        """Returns to the driver what torch's allocator keeps free in this worker (vLLM's
        sleep frees its own pools, not torch's cache: what its activations and a direct
        load's check left there)."""
        import torch
        torch.cuda.empty_cache()

    def wsync_channel(self, directory: str) -> str:
        """Opens this worker's channel (wsync.vllm.worker.channel) in ``directory``: a thread of its
        own answers the weight commands from now on; the socket's path."""
        from .channel import serve
        path = os.path.join(directory, f"tp{compat.worker_rank(self)}.sock")

        def start() -> None:
            import torch
            torch.cuda.set_device(compat.worker_device(self))
        serve(path, self.wsync_command, start)
        return path

    def wsync_command(self, cmd: str, payload_json: str) -> str:
        """Runs one weight command on this worker; answers JSON {ok, result} or {ok: false,
        error: {code, message, fatal, traceback}} (an exception must not end vLLM's worker
        loop: the runtime decides)."""
        started = time.perf_counter()
        try:
            payload = json.loads(payload_json)
            loader = self.__dict__.get("_wsync_loader")
            if cmd == "init_weights":
                from ... import Host
                host = self.__dict__.get("_wsync_host") or Host()
                self.__dict__["_wsync_host"] = host
                identity = self.wsync_identity()
                mode = payload.get("load", "direct")
                if mode not in ("direct", "native"):
                    raise Failure("INVALID_ARGUMENT", f"load mode {mode!r} is neither direct nor native", fatal=True)
                if loader is None or loader.mode != mode:
                    if mode == "direct":
                        loader = CheckedDirectLoader(self, identity, host)
                    else:
                        loader = _Native(self, identity, host)
                    self.__dict__["_wsync_loader"] = loader
            elif loader is None:
                raise Failure("NOT_INITIALIZED", f"{cmd} before init_weights", fatal=True)
            handler = getattr(loader, cmd, None)
            if handler is None:
                raise Failure("UNKNOWN_COMMAND", f"the worker extension has no command '{cmd}'")
            loader.parts = {}
            result = handler(payload)
            # (How long this worker took, and the parts its loader named, for the runtime's
            # timing summary: the rest of a command's time is the trip to this worker.)
            return json.dumps({"ok": True, "result": result, "seconds": time.perf_counter() - started,
                               "parts": loader.parts})
        except Failure as failed:
            return json.dumps({"ok": False, "error": {"code": failed.code, "message": failed.message,
                                                      "fatal": failed.fatal}})
        except Exception as error:
            return json.dumps({"ok": False, "error": {"code": "WORKER_FAILED", "fatal": True,
                                                      "message": f"{cmd}: {type(error).__name__}: {error}",
                                                      "traceback": traceback.format_exc()}})
