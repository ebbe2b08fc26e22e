"""The check of wsync's direct FP8 loader against vLLM's own FP8 loader
(wsync.vllm.worker.extension.CheckedDirectLoader under a quantization), without vLLM: a model
of torch modules on the CPU, the direct loader's copy and vLLM's layerwise reload replaced by
one stand-in "quantization" (a resident holds the high byte of each bfloat16 element of the
tensors that fill it, in the plan's order), and the stand-in reload refusing a module that
did not get all of its tensors, as vLLM's fills the rest with uninitialized memory."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from wsync.vllm import compat
from wsync.vllm.failure import Failure
from wsync.vllm.worker import extension
from wsync.vllm.worker.extension import CheckedDirectLoader, reload_units

WRITES = {"q": ["l.qkv.weight"], "k": ["l.qkv.weight"], "v": ["l.qkv.weight"],
          "gate": ["l.experts.w13_weight"], "up": ["l.experts.w13_weight"], "down": ["l.experts.w2_weight"],
          "norm": ["l.norm.weight"], "elsewhere": []}
ELEMENTS = {"q": 8, "k": 4, "v": 4, "gate": 6, "up": 6, "down": 6, "norm": 2, "elsewhere": 3}


def quantized(values: torch.Tensor) -> torch.Tensor:
    return values.reshape(-1).view(torch.uint8)[1::2]


def place(tensor: str) -> tuple[str, int]:
    """The resident ``tensor`` fills and its first byte there."""
    resident = WRITES[tensor][0]
    before = [other for other, residents in WRITES.items() if residents == [resident]]
    return resident, sum(ELEMENTS[other] for other in before[:before.index(tensor)])


class Engine:
    """The model, its packed buffer, and vLLM's reload in place of the worker's."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, padded: dict[str, int] | None = None) -> None:
        self.model = torch.nn.Module()
        sizes: dict[str, int] = {}
        for tensor, residents in WRITES.items():
            for resident in residents:
                sizes[resident] = sizes.get(resident, 0) + ELEMENTS[tensor]
        self.sizes = dict(sizes)  # (the loader plan's; the engine may hold a resident padded)
        sizes.update(padded or {})
        for name, size in sizes.items():
            *path, leaf = name.split(".")
            module = self.model
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(torch.zeros(size, dtype=torch.uint8),
                                                               requires_grad=False))
        self.values = {name: torch.randn(count, dtype=torch.bfloat16) for name, count in ELEMENTS.items()}
        self.calls: list[Any] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.reloading = False
        self.corrupt: set[str] = set()  # (tensors the stand-in direct loader writes wrong)
        for name, value in [("worker_model", lambda worker: self.model),
                            ("worker_device", lambda worker: torch.device("cpu")),
                            ("start_weight_update", lambda worker: self.start()),
                            ("load_weights", lambda model, weights: self.load(weights)),
                            ("finish_weight_update", lambda worker: self.finish())]:
            monkeypatch.setattr(compat, name, value)

    def parameter(self, resident: str) -> torch.Tensor:
        return self.model.get_parameter(resident).data

    def start(self) -> None:
        assert not self.reloading
        self.reloading, self.loaded = True, {}
        self.calls.append("start")

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        assert self.reloading
        self.calls.append([name for name, _ in weights])
        self.loaded.update((name, tensor.clone()) for name, tensor in weights)

    def finish(self) -> None:
        self.reloading = False
        self.calls.append("finish")
        modules = {resident.rsplit(".", 1)[0] for name in self.loaded for resident in WRITES[name]}
        for tensor, residents in WRITES.items():
            if any(resident.rsplit(".", 1)[0] in modules for resident in residents):
                assert tensor in self.loaded, f"a module reloaded without {tensor}"
                resident, first = place(tensor)
                self.parameter(resident)[first:first + ELEMENTS[tensor]] = quantized(self.loaded[tensor])

    def loader(self, chunks: list[list[str]]) -> tuple[CheckedDirectLoader, torch.Tensor, list[list[dict]]]:
        """A checked direct loader over this engine, its packed buffer and the chunks'
        tensors (each chunk from byte 0 of the buffer)."""
        loader = CheckedDirectLoader.__new__(CheckedDirectLoader)
        loader.worker, loader.identity = object(), {"rank": 0}
        loader.check, loader.checked, loader.checking, loader.chunks, loader.waiting = "every", False, True, {}, {}
        loader.plan = type("Plan", (), {"writes": WRITES, "residents": [
            {"name": name, "shape": [size], "dtype": "uint8", "bytes": size} for name, size in self.sizes.items()]})()
        loader.units = reload_units(WRITES)
        buffer = torch.zeros(2 * sum(ELEMENTS.values()), dtype=torch.uint8)
        described = []
        for chunk in chunks:
            offset, tensors = 0, []
            for name in chunk:
                tensors.append({"name": name, "offset": offset, "bytes": 2 * ELEMENTS[name], "dtype": "bfloat16",
                                "shape": [ELEMENTS[name]]})
                offset += 2 * ELEMENTS[name]
            described.append(tensors)

        def call(cmd: str, payload: dict) -> dict:
            assert cmd == "load_chunk"
            for tensor in described[payload["chunk"] - 1]:
                buffer[tensor["offset"]:tensor["offset"] + tensor["bytes"]] = \
                    self.values[tensor["name"]].view(torch.uint8)
                if WRITES[tensor["name"]]:
                    resident, first = place(tensor["name"])
                    written = quantized(self.values[tensor["name"]]).clone()
                    if tensor["name"] in self.corrupt:
                        written[1] ^= 1
                    self.parameter(resident)[first:first + ELEMENTS[tensor["name"]]] = written
            return {}
        loader._call = call  # type: ignore[method-assign]
        loader._memories = lambda tensors, slot: {slot: buffer}  # type: ignore[method-assign]
        return loader, buffer, described


def test_a_reload_unit_is_the_tensors_of_whole_modules():
    units = reload_units(WRITES)
    assert units["q"] == units["v"] == {"q", "k", "v"}
    # (w13 and w2 are one module's: vLLM's reload quantizes them together)
    assert units["gate"] == units["down"] == {"gate", "up", "down"}
    assert units["norm"] == {"norm"} and "elsewhere" not in units
    # a tensor that fills two modules joins them
    joined = reload_units({"embed": ["embed.weight", "head.weight"], "head": ["head.weight"], "n": ["n.weight"]})
    assert joined["head"] == {"embed", "head"} and joined["n"] == {"n"}


def test_each_module_is_reloaded_by_vllm_once_all_of_it_has_come(monkeypatch):
    engine = Engine(monkeypatch)
    loader, buffer, chunks = engine.loader([["q", "k", "v", "gate"], ["up", "down", "norm", "elsewhere"]])
    loader.load_chunk({"chunk": 1, "buffer": 1, "tensors": chunks[0]})
    assert engine.calls == ["start", ["q", "k", "v"], "finish"]
    # the expert's gate waits past its chunk, cloned out of the buffer the next chunk reuses
    assert list(loader.waiting) == ["gate"] and loader.waiting["gate"].data_ptr() != buffer.data_ptr() + 32
    loader.load_chunk({"chunk": 2, "buffer": 1, "tensors": chunks[1]})
    assert engine.calls[3:] == ["start", ["gate", "up", "down", "norm"], "finish"]
    assert torch.equal(engine.loaded["gate"], engine.values["gate"])
    assert loader.waiting == {}


def test_a_byte_vllm_quantizes_otherwise_fails_naming_the_parameter(monkeypatch):
    engine = Engine(monkeypatch)
    engine.corrupt = {"up"}
    loader, _, chunks = engine.loader([["q", "k", "v", "gate", "up", "down", "norm"]])
    with pytest.raises(Failure) as failed:
        loader.load_chunk({"chunk": 1, "buffer": 1, "tensors": chunks[0]})
    assert failed.value.code == "DIRECT_PLAN_MISMATCH" and failed.value.fatal
    assert failed.value.message.startswith("chunk 1: vLLM's own FP8 loader (its layerwise reload) writes "
                                           "l.experts.w13_weight differently from wsync's direct loader (first "
                                           "at byte 7 of 12, element [7] of [12]: ")
    assert failed.value.message.endswith("; 1 bytes differ); load = \"native\" serves this model")


def test_a_resident_the_engine_holds_padded_is_compared_over_the_plans_part(monkeypatch):
    # (vLLM's CUTLASS FP8 kernel pads a router of 8 experts to 16 rows; its reload writes
    # zeros there, where the first load left what it left.)
    engine = Engine(monkeypatch, padded={"l.norm.weight": 6})
    engine.parameter("l.norm.weight")[2:] = 0x5A
    original = engine.finish

    def finish() -> None:
        original()
        engine.parameter("l.norm.weight")[2:] = 0
    monkeypatch.setattr(compat, "finish_weight_update", lambda worker: finish())
    loader, _, chunks = engine.loader([["q", "k", "v", "gate", "up", "down", "norm"]])
    loader.load_chunk({"chunk": 1, "buffer": 1, "tensors": chunks[0]})
    assert engine.parameter("l.norm.weight")[:2].tolist() == quantized(engine.values["norm"]).tolist()
    engine.corrupt = {"norm"}
    with pytest.raises(Failure) as failed:
        loader.load_chunk({"chunk": 1, "buffer": 1, "tensors": chunks[0]})
    assert "writes l.norm.weight differently from wsync's direct loader (first at byte 1 of 2, element [1] of [2]" \
        in failed.value.message


def test_a_module_the_publication_leaves_partly_out_is_counted_unchecked(monkeypatch):
    engine = Engine(monkeypatch)
    loader, _, chunks = engine.loader([["q", "k", "v", "gate", "up", "norm"]])
    loader.load_chunk({"chunk": 1, "buffer": 1, "tensors": chunks[0]})
    assert engine.calls == ["start", ["q", "k", "v", "norm"], "finish"]
    monkeypatch.setattr(extension.DirectLoader, "finish_update", lambda self, payload: {})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    assert loader.finish_update({}) == {"checked_against_vllm": True, "unchecked_tensors": 2}
    assert loader.waiting == {}


def test_a_bounded_group_holds_whole_modules(monkeypatch):
    # (w13 and w2 are one module's: with a bound below any parameter each module goes alone,
    # never the experts' w13 without their w2)
    engine = Engine(monkeypatch)
    monkeypatch.setattr(extension, "CHECK_GROUP_BYTES", 1)
    loader, _, chunks = engine.loader([["gate", "up", "down", "q", "k", "v", "norm"]])
    loader.load_chunk({"chunk": 1, "buffer": 1, "tensors": chunks[0]})
    assert engine.calls == ["start", ["gate", "up", "down"], "finish", "start", ["q", "k", "v"], "finish",
                            "start", ["norm"], "finish"]
