"""wsync.vllm.extension.TorchFingerprint: the direct loader's test that vLLM's parameters lie
where they were bound, on a torch module on the CPU."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed here")

from wsync.vllm.extension import TorchFingerprint  # noqa: E402


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
