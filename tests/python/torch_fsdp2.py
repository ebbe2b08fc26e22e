"""A PyTorch trainer embedding wsync: a tiny Qwen3-MoE from transformers (random init, no
download), sharded with FSDP2 on one rank, trained for three AdamW steps; after each step it
publishes through wsync into the reference runtime, the session running in this process
(wsync.Host). The recipe's schedule offloads the optimizer's state to the CPU and brings it
back through this trainer's callbacks, and checks every resident slice against the trainer's
updated parameters (verify = "values"). Prints one line per publication and "torch_fsdp2: ok";
exits non-zero on any failure.

    --device cuda (the H200: tests/gpu/run.sh): NCCL, the cuda backend,
        tests/fixtures/recipes/torch_tiny_cuda.lua
    --device cuda-direct (the H200): the same on the direct path, the TP worker reading the
        parameters from torch's own allocations, tests/fixtures/recipes/torch_tiny_cuda_direct.lua
    --device cpu (tests/python/test_torch.py, where torch is installed): gloo, the host
        backend, tests/fixtures/recipes/torch_tiny_host.lua
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import wsync

RECIPES = {"cuda": "tests/fixtures/recipes/torch_tiny_cuda.lua", "cpu": "tests/fixtures/recipes/torch_tiny_host.lua",
           "cuda-direct": "tests/fixtures/recipes/torch_tiny_cuda_direct.lua"}
STEPS = 3


def tiny_config() -> Qwen3MoeConfig:
    # wsync's "tiny" preset (scripts/wsync/plan/qwen3_moe.lua).
    return Qwen3MoeConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False, decoder_sparse_step=1,
                          mlp_only_layers=[], max_position_embeddings=256)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=sorted(RECIPES), default="cuda")
    device = parser.parse_args().device
    recipe = RECIPES[device]
    device = "cuda" if device.startswith("cuda") else device
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(tiny_config()).to(device, torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    offload = wsync.OptimizerOffload(optimizer)

    expected = [tensor.name for tensor in wsync.trainer_tensors(recipe)]
    with wsync.Host(recipe) as host:
        agent = host.agent(rank=0, world=1, backend="cuda" if device == "cuda" else "host", device=0)
        names = agent.register_module(model)
        if sorted(names) != sorted(expected):
            print(f"torch_fsdp2: the model's parameters {sorted(set(names) ^ set(expected))} differ from the "
                  "recipe's trainer tensors", file=sys.stderr)
            return 1
        agent.register_callback("offload_optimizer", offload.offload)
        agent.register_callback("onload_optimizer", offload.onload)
        agent.ready()
        before = None
        for step in range(1, STEPS + 1):
            tokens = torch.randint(0, 1000, (2, 16), device=device)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            weight = model.model.layers[0].mlp.experts.gate_up_proj.to_local().float().sum().item()
            if before is not None and weight == before:
                print("torch_fsdp2: the optimizer step changed nothing", file=sys.stderr)
                return 1
            before = weight
            publication = agent.publish(step)
            print(f"torch_fsdp2: step {step}: loss {loss.item():.4f}, model version {publication.model_version}, "
                  f"receipts {publication.receipts}", flush=True)
    dist.destroy_process_group()
    if offload.moved == 0 or offload.offloaded:
        print(f"torch_fsdp2: the optimizer state moved {offload.moved} tensors and {len(offload.offloaded)} stayed "
              "offloaded", file=sys.stderr)
        return 1
    print(f"torch_fsdp2: ok ({STEPS} publications checked against the parameters; the optimizer state moved "
          f"out and back {offload.moved} tensors in all)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
