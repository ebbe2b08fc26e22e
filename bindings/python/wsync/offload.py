"""Step callbacks that move a PyTorch trainer's memory for a recipe's schedule.

    offload = wsync.OptimizerOffload(optimizer)
    agent.register_callback("offload_optimizer", offload.offload)
    agent.register_callback("onload_optimizer", offload.onload)

torch is imported when a callback runs, never by ``import wsync``.
"""
from __future__ import annotations

from typing import Any


class OptimizerOffload:
    """Moves an optimizer's state tensors to the CPU (``offload``) and back to where they
    were (``onload``). Scalars stay where they are: AdamW's ``step`` counters live on the
    CPU already. A state tensor on the CPU is copied all the same, so that it has new
    storage as an offloaded one would. ``moved`` counts the tensors offloaded so far."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.offloaded: list[tuple[dict[str, Any], str, Any]] = []  # (state, key, the device it came from)
        self.moved = 0

    def offload(self) -> None:
        """Copies every state tensor to the CPU and frees the device's copy (the step
        callback ``"offload_optimizer"``)."""
        import torch  # noqa: PLC0415 (only a trainer with an optimizer needs it)
        if self.offloaded:
            raise RuntimeError("offload_optimizer: the optimizer is offloaded already")
        for state in self.optimizer.state.values():
            for key, value in list(state.items()):
                if torch.is_tensor(value) and value.dim() > 0:
                    state[key] = value.to("cpu", copy=True)
                    self.offloaded.append((state, key, value.device))
        self.moved += len(self.offloaded)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Copies the offloaded state tensors back to their devices (the step callback
        ``"onload_optimizer"``)."""
        for state, key, device in self.offloaded:
            state[key] = state[key].to(device, copy=True)
        self.offloaded.clear()
