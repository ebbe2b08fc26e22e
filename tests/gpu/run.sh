#!/usr/bin/env bash
# On the GPU machine: runs the GPU test tier, the PyTorch/FSDP2 trainer
# through the Python package (tests/python/torch_fsdp2.py), and the GPU benchmarks (the
# batched copy kernel against the floors, whole 30B-A3B publications) from
# the bundle that `scripts/dev.sh bundle` made here (carried as build/bundle),
# writing every log under $OUT (default ./gpu-out) and a summary.
#
#   tests/gpu/run.sh [SCALE]     SCALE: the copy benchmark's fraction of the
#                                30B-A3B bytes (default 1: 61.06 GB)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
out=${OUT:-./gpu-out}
mkdir -p "$out"
scale=${1:-1}
# shellcheck source=/dev/null
source build/bundle/env.sh
{
  echo "== machine"
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>&1
  nproc
  date -u
} >"$out/machine.txt" 2>&1
status=0
echo "== gpu tier" | tee "$out/summary.txt"
timeout 420 wsync test tests/gpu -o utfTerminal >"$out/gpu_tier.log" 2>&1 || status=1
tail -n 3 "$out/gpu_tier.log" | tee -a "$out/summary.txt"
grep -E "^(Failure|Error) ->" -A6 "$out/gpu_tier.log" | head -60 | tee -a "$out/summary.txt"
echo "== python: FSDP2 trainer through wsync (tests/python/torch_fsdp2.py --device cuda)" | tee -a "$out/summary.txt"
timeout 300 python3 tests/python/torch_fsdp2.py --device cuda >"$out/torch_fsdp2.log" 2>&1 || status=1
grep -E "^torch_fsdp2|verdict|Error|error" "$out/torch_fsdp2.log" | tail -n 20 | tee -a "$out/summary.txt"
echo "== cuda copy benchmark (scale $scale)" | tee -a "$out/summary.txt"
timeout 150 wsync tests/bench/cuda_copy.lua "$scale" 3 >"$out/cuda_copy.log" 2>&1 || status=1
tail -n 30 "$out/cuda_copy.log" | tee -a "$out/summary.txt"
echo "== cuda publish benchmark" | tee -a "$out/summary.txt"
timeout 200 wsync tests/bench/cuda_publish.lua 4,8,direct 5 >"$out/cuda_publish.log" 2>&1 || status=1
grep -v "^trainer rank\|^wsync:" "$out/cuda_publish.log" | tail -n 12 | tee -a "$out/summary.txt"
exit $status
