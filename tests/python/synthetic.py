"""A trainer's side of the Python tests: the tiny Qwen3-MoE's trainer tensors (the
transformers-v5 layout, as scripts/wsync/plan/qwen3_moe.lua lists them) and wsync's
synthetic values (host/synth.c), computed here with numpy, apart from wsync, so that the
host's check of every resident slice compares values made by two implementations."""
from __future__ import annotations

import numpy as np

# The tiny preset: vocab 1000, hidden 64, moe_intermediate 32, 2 layers, 4 heads, 2 KV
# heads, head_dim 16, 4 experts, untied embeddings.
V, H, I, LAYERS, HEADS, KV_HEADS, HEAD_DIM, EXPERTS = 1000, 64, 32, 2, 4, 2, 16, 4

MASK = (1 << 64) - 1


def layout() -> list[tuple[str, tuple[int, ...]]]:
    """The trainer tensors in wsync's order: (name, global shape)."""
    tensors = [("model.embed_tokens.weight", (V, H))]
    for layer in range(LAYERS):
        p = f"model.layers.{layer}."
        tensors += [
            (p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, H)),
            (p + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, H)),
            (p + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, H)),
            (p + "self_attn.o_proj.weight", (H, HEADS * HEAD_DIM)),
            (p + "self_attn.q_norm.weight", (HEAD_DIM,)),
            (p + "self_attn.k_norm.weight", (HEAD_DIM,)),
            (p + "mlp.gate.weight", (EXPERTS, H)),
            (p + "mlp.experts.gate_up_proj", (EXPERTS, 2 * I, H)),
            (p + "mlp.experts.down_proj", (EXPERTS, H, I)),
            (p + "input_layernorm.weight", (H,)),
            (p + "post_attention_layernorm.weight", (H,)),
        ]
    tensors += [("model.norm.weight", (H,)), ("lm_head.weight", (V, H))]
    return tensors


def rows(global_rows: int, rank: int, world: int) -> tuple[int, int]:
    """This rank's rows of dim 0 as torch.chunk (and FSDP2's Shard(0)) split them."""
    chunk = -(-global_rows // world)
    first = min(rank * chunk, global_rows)
    return first, min(chunk, global_rows - first)


def seed(name: str) -> int:
    """FNV-1a of the name (ws_synth_seed)."""
    value = 1469598103934665603
    for byte in name.encode():
        value = ((value ^ byte) * 1099511628211) & MASK
    return value


def _mix_int(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK
    return value ^ (value >> 31)


def _mix(values: np.ndarray) -> np.ndarray:
    values = values + np.uint64(0x9E3779B97F4A7C15)
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


def bfloat16_bits(name: str, first: int, count: int, version: int) -> np.ndarray:
    """Elements [first, first + count) of tensor `name` at `version`, as bfloat16 bits (uint16)."""
    key = _mix_int(seed(name) ^ _mix_int((version * 0x632BE59BD9B4E019) & MASK))
    index = np.arange(count, dtype=np.uint64) + np.uint64((key + first) & MASK)
    bits = _mix(index)
    sign = (bits >> np.uint64(63)) << np.uint64(31)
    exponent = (np.uint64(119) + (bits >> np.uint64(40)) % np.uint64(9)) << np.uint64(23)
    mantissa = bits & np.uint64(0x7FFFFF)
    return ((sign | exponent | mantissa) >> np.uint64(16)).astype(np.uint16)


def fill(array: np.ndarray, name: str, shape: tuple[int, ...], first_row: int, version: int) -> None:
    """Writes version `version`'s values of this rank's rows into `array` (uint16, bfloat16 bits)."""
    row_elements = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    array.reshape(-1)[:] = bfloat16_bits(name, first_row * row_elements, array.size, version)
