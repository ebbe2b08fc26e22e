"""What tests/gpu/vllm_e2e.py and tests/gpu/vllm_keep.py share: one FSDP2 trainer rank of
the small Qwen3-MoE (tests/fixtures/models/gpu_tiny, random init, no download) on GPU 0,
its AdamW optimizer offloaded and brought back by the recipe's schedule, registered with
a session's agent; and the closing verdict."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import wsync

ROOT = Path(__file__).resolve().parents[2]

MODEL = ROOT / "tests" / "fixtures" / "models" / "gpu_tiny"


class Trainer:
    """The rank: ``config``, ``model`` (FSDP2, bfloat16), ``optimizer``; ``prepare`` may change
    the model before it is sharded."""

    def __init__(self, prepare: Optional[Callable[[torch.nn.Module], None]] = None) -> None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        os.chdir(ROOT)
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
        torch.manual_seed(0)
        self.config = Qwen3MoeConfig.from_pretrained(str(MODEL))
        self.model = Qwen3MoeForCausalLM(self.config).to("cuda", torch.bfloat16)
        if prepare is not None:
            with torch.no_grad():
                prepare(self.model)
        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.offload = wsync.OptimizerOffload(self.optimizer)

    def agent(self, host: Any) -> Any:
        """The session's agent of this rank, its model and callbacks registered, ready."""
        agent = host.agent(rank=0, world=1, backend="cuda", device=0)
        agent.register_module(self.model)
        agent.register_callback("offload_optimizer", self.offload.offload)
        agent.register_callback("onload_optimizer", self.offload.onload)
        agent.ready()
        return agent

    def step(self) -> float:
        """One optimizer step on random tokens; its loss."""
        tokens = torch.randint(0, self.config.vocab_size, (4, 32), device="cuda")
        loss = self.model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()

    def close(self) -> None:
        dist.destroy_process_group()


def verdict(name: str, failures: list[str], ok: str) -> int:
    """Prints the failures (stderr) or "NAME: ok (OK)"; the exit status."""
    for failure in failures:
        print(f"{name}: FAILED: {failure}", file=sys.stderr)
    if failures:
        return 1
    print(f"{name}: ok ({ok})", flush=True)
    return 0
