"""wsync's host reference of the FP8 transform (host/fp8.c, run by the wsync binary) against
torch's own float8_e4m3fn cast, bitwise, on random bfloat16 groups: the scale is
float32(amax |x|) / 448, and each element is x * (1 / scale) clamped to +-448 and cast, as
vLLM's per-tensor kernel does (bindings/python/wsync/vllm/FP8.md, section 3.1)."""
from __future__ import annotations

import subprocess

import pytest
import torch

from conftest import wsync_binary

# Runs in the wsync binary: reads `arg[1]` (bfloat16 groups back to back, their element
# counts in arg[3..]) and writes arg[2]: the float8 bytes, then the float32 scales.
TRANSFORM = r"""
local fp8 = require("wsync.native.fp8")
local shm = require("wsync.native.shm")
local ffi = require("ffi")
local input = assert(io.open(arg[1], "rb")):read("*a")
local counts = {}
for i = 3, #arg do counts[#counts + 1] = tonumber(arg[i]) end
local elements = #input / 2
local source = assert(shm.anonymous(#input))
ffi.copy(ffi.cast("void *", source:pointer()), input, #input)
local target = assert(shm.anonymous(elements + 4 * #counts))
local transform = fp8.transform()
local first = 0
for g, count in ipairs(counts) do
  local group = transform:add_group(0, elements + 4 * (g - 1))
  -- (Each group in two pieces, as q and k of a fused qkv come.)
  local half = math.floor(count / 2)
  transform:add({ group = group, target_offset = first, source_offset = 2 * first, rows = 1, columns = half })
  transform:add({ group = group, target_offset = first + half, source_offset = 2 * (first + half), rows = 1,
    columns = count - half })
  first = first + count
end
assert(fp8.run(target, source, transform))
local output = assert(io.open(arg[2], "wb"))
output:write(ffi.string(ffi.cast("const char *", target:pointer()), elements + 4 * #counts))
output:close()
source:close()
target:close()
"""


def reference(group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's quantization of one bfloat16 group: its float8 bytes and its float32 scale."""
    values = group.float()
    scale = values.abs().max() / 448.0
    scaled = values * (1.0 / scale)
    # (fmin and fmax, as the kernel's fminf and fmaxf, pass NaN over: torch's clamp would keep it.)
    clamped = torch.fmax(torch.fmin(scaled, torch.tensor(448.0)), torch.tensor(-448.0))
    return clamped.to(torch.float8_e4m3fn).view(torch.uint8), scale.reshape(1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_host_reference_is_torchs_cast_bitwise(tmp_path, seed):
    generator = torch.Generator().manual_seed(seed)
    groups = []
    for size in (1, 2, 7, 64, 1000, 4096):
        # (Magnitudes from 2^-20 to 2^20, so that subnormals, ties and the clamp all come up.)
        mantissa = torch.randn(size, generator=generator)
        exponent = torch.randint(-20, 21, (size,), generator=generator).float()
        groups.append((mantissa * torch.pow(2.0, exponent)).to(torch.bfloat16))
    groups.append(torch.tensor([0.0, -0.0, 0.0], dtype=torch.bfloat16))  # all zero: scale 0, elements 0x7e
    groups.append(torch.tensor([448.0, -448.0, 1.0, -1e-3], dtype=torch.bfloat16))
    source = torch.cat(groups)
    (tmp_path / "in").write_bytes(source.view(torch.int16).numpy().tobytes())
    (tmp_path / "transform.lua").write_text(TRANSFORM)
    result = subprocess.run([wsync_binary(), str(tmp_path / "transform.lua"), str(tmp_path / "in"), str(tmp_path / "out")]
                            + [str(group.numel()) for group in groups], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    out = torch.frombuffer(bytearray((tmp_path / "out").read_bytes()), dtype=torch.uint8)
    elements = source.numel()
    weights, scales = out[:elements], out[elements:].clone().view(torch.float32)
    first = 0
    for index, group in enumerate(groups):
        expected, scale = reference(group)
        got = weights[first:first + group.numel()]
        assert torch.equal(scales[index:index + 1].view(torch.int32), scale.view(torch.int32)), (index, scale)
        mismatch = (got != expected).nonzero()
        assert mismatch.numel() == 0, (index, int(mismatch[0]), float(group[int(mismatch[0])]),
                                       int(got[int(mismatch[0])]), int(expected[int(mismatch[0])]))
        first += group.numel()


def test_torch_residents_lists_vllms_fp8_weights_as_views_of_their_storage():
    from wsync.vllm.failure import Failure
    from wsync.vllm.worker.extension import torch_residents

    class Linear(torch.nn.Module):
        def __init__(self, weight: torch.Tensor) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(weight, requires_grad=False)
            self.weight_scale = torch.nn.Parameter(torch.ones(1), requires_grad=False)

    # (As vLLM's online FP8 holds a dense weight: float8 [in, out], the transpose of row-major
    # [out, in] storage, and one float32 scale.)
    storage = torch.zeros(6, 4, dtype=torch.float8_e4m3fn)
    model = torch.nn.Module()
    model.qkv_proj = Linear(storage.t())
    found = torch_residents(model)
    assert found["qkv_proj.weight"] == {"pointer": storage.data_ptr(), "size": 24, "dtype": "float8_e4m3fn",
                                        "shape": [4, 6], "stride": [1, 4]}
    assert found["qkv_proj.weight_scale"]["stride"] == [1]
    # Any other non-contiguous layout is refused, named.
    model.qkv_proj = Linear(torch.zeros(6, 8, dtype=torch.float8_e4m3fn)[:, ::2])
    with pytest.raises(Failure, match="vLLM's parameter qkv_proj.weight is neither contiguous nor the transpose"):
        torch_residents(model)
