"""wsync.vllm.worker.extension.TorchFingerprint: the direct loader's test that vLLM's parameters lie
where they were bound, on a torch module on the CPU."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed here")

from wsync.vllm.worker.extension import TorchFingerprint, torch_residents  # noqa: E402


def model() -> "torch.nn.Module":
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2, bias=False))


def test_it_stays_while_nothing_moves_and_changes_with_each_kind_of_change():
    net = model()
    fingerprint = TorchFingerprint(lambda: net)
    first = fingerprint()
    assert fingerprint() == first and fingerprint() == first
    changes = [
        lambda: setattr(net[0].weight, "data", torch.zeros(4, 4)),  # moved: new storage
        lambda: setattr(net[2], "weight", torch.nn.Parameter(torch.zeros(2, 4))),  # replaced
        lambda: setattr(net[1].bias, "data", torch.zeros(4, dtype=torch.float64)),  # another dtype
        lambda: setattr(net[1].weight, "data", torch.zeros(2)),  # another shape
    ]
    seen = {first}
    for change in changes:
        change()
        value = fingerprint()
        assert value not in seen
        assert fingerprint() == value  # (and stays until the next change)
        seen.add(value)


def test_another_model_changes_it():
    nets = [model()]
    fingerprint = TorchFingerprint(lambda: nets[-1])
    first = fingerprint()
    nets.append(model())
    assert fingerprint() != first


class Dispatching(torch.nn.Parameter):
    """A parameter whose subclass defines ``__torch_function__`` in Python, as vLLM 0.26's
    linear layers' ``BasevLLMParameter`` does; counts its calls."""

    calls = 0

    def __new__(cls, data: "torch.Tensor") -> "Dispatching":
        return super().__new__(cls, data=data, requires_grad=False)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        Dispatching.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_parameters_with_python_dispatch_are_read_without_it_and_still_followed():
    net = model()
    net[0].weight = Dispatching(torch.zeros(4, 4))
    fingerprint = TorchFingerprint(lambda: net)
    first = fingerprint()
    Dispatching.calls = 0
    assert fingerprint() == first
    assert torch_residents(net)["0.weight"]["shape"] == [4, 4]
    assert Dispatching.calls == 0  # (each call costs microseconds: thousands a publication)
    net[0].weight.data = torch.zeros(4, 4)  # moved
    assert fingerprint() != first
