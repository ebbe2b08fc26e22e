#!/usr/bin/env bash
# On the GPU machine: runs the GPU test tier, the PyTorch/FSDP2 trainer through the
# Python package (tests/python/torch_fsdp2.py), the GPU benchmarks (the batched copy
# kernel against the floors, its loop shapes, whole 30B-A3B publications) and, when the vLLM bundle is
# carried (.vllm, ../shared/tools/vllm-bundle), the vLLM specs, the RL example and the
# benchmark against vLLM's own weight sync, from the bundle that `scripts/dev.sh bundle` made here (carried
# as build/bundle or build/bundle.tar.xz), writing every log under $OUT (default
# ./gpu-out) and a summary.
#
#   [STAGES="tier fsdp2 copy shapes publish host-time offload host-pinned vllm vllm-fp8 vllm-faults vllm-memory colocated example vllm-bench rl-step"] [VLLM_WAYS=WAY,...] tests/gpu/run.sh [SCALE]
#     STAGES: which to run (default all; one device call has 10 minutes)
#     VLLM_WAYS: the benchmark's ways beside vLLM's own (tests/bench/vllm_publish.py;
#       default "direct storage,direct 2x4GiB,native")
#     SCALE: the copy benchmark's fraction of the 30B-A3B bytes (default 1: 61.06 GB)
#     example: the RL example (bindings/python/examples/grpo.py, 50 steps), checked by
#       tests/gpu/rl_example.py: the reward rises, the mismatch stays at bfloat16's rounding,
#       every generation is of the version just published; its output in rl_example.log,
#       its plot in rl_example.png
#     rl-step: the RL step's publication with the engine live, three model sizes
#       (tests/bench/rl_step.py; its own device call: about 5 minutes)
#     host-time: the host's time outside copies per publication at the 30B-A3B's and the
#       235B's tensor counts (tests/bench/publish_bandwidth.lua layout)
#     offload: the schedule's torch offloads against the pinned copy (tests/bench/offload.py)
#     host-pinned: the pinned copy by how its host memory was allocated, and 0-1000 ms after
#       another process released device memory
#       (tests/bench/host_pinned.py)
#     vllm-fp8: vllm_spec's FP8 rollout cases (#fp8: vllm_e2e.py --load direct-fp8 and
#       native-fp8), a device call of their own
#     vllm-memory: vLLM's device memory in each sleep/wake state (tests/gpu/vllm_memory.py),
#       the memory model's calibration
#     colocated: a 4.4 B Qwen3-MoE that fits beside vLLM only by the schedule, 10 RL steps
#       (COLOCATED_STEPS=N: N; 2 at least for the switch's medians), each step's memory
#       against the model and the switch against its floor (tests/bench/colocated.py; its
#       own device call: about 3 minutes, 2 of them before the first step)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
out=${OUT:-./gpu-out}
mkdir -p "$out"
scale=${1:-1}
stages=" ${STAGES:-tier fsdp2 copy shapes publish host-time offload host-pinned vllm vllm-fp8 vllm-faults vllm-memory colocated example vllm-bench rl-step} "
# The bundle, or its archive (carried beside the vLLM bundle: both must fit in one
# run's 64 MiB).
if [ ! -f build/bundle/env.sh ] && [ -f build/bundle.tar.xz ]; then
  tar -C build -xJf build/bundle.tar.xz
fi
# shellcheck source=/dev/null
source build/bundle/env.sh
{
  echo "== machine"
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>&1
  nproc
  date -u
} >"$out/machine.txt" 2>&1
status=0
stage() { [[ "$stages" == *" $1 "* ]]; }
if stage tier; then
  echo "== gpu tier" | tee "$out/summary.txt"
  # (Without vLLM's own engine, #vllm, even where the vLLM bundle is active already: the
  # vllm stage runs those, and with them the tier would not fit one device call.)
  timeout 540 wsync test tests/gpu --exclude-tags=vllm -o utfTerminal >"$out/gpu_tier.log" 2>&1 || status=1
  tail -n 3 "$out/gpu_tier.log" | tee -a "$out/summary.txt"
  grep -E "^(Failure|Error) ->" -A6 "$out/gpu_tier.log" | head -60 | tee -a "$out/summary.txt"
fi
if stage fsdp2; then
  for way in cuda cuda-direct; do
    echo "== python: FSDP2 trainer through wsync (tests/python/torch_fsdp2.py --device $way)" | tee -a "$out/summary.txt"
    timeout 300 python3 tests/python/torch_fsdp2.py --device "$way" >"$out/torch_fsdp2_$way.log" 2>&1 || status=1
    grep -E "^torch_fsdp2|verdict|Error|error" "$out/torch_fsdp2_$way.log" | tail -n 20 | tee -a "$out/summary.txt"
  done
fi
if stage copy; then
  echo "== cuda copy benchmark (scale $scale)" | tee -a "$out/summary.txt"
  timeout 150 wsync tests/bench/cuda_copy.lua "$scale" 3 >"$out/cuda_copy.log" 2>&1 || status=1
  tail -n 30 "$out/cuda_copy.log" | tee -a "$out/summary.txt"
fi
if stage shapes; then
  echo "== copy kernel loop shapes (tests/bench/copy_shapes.cu, 8 GiB)" | tee -a "$out/summary.txt"
  timeout 120 wsync_copy_shapes 8 >"$out/copy_shapes.log" 2>&1 || status=1
  tail -n 24 "$out/copy_shapes.log" | tee -a "$out/summary.txt"
fi
if stage publish; then
  echo "== cuda publish benchmark" | tee -a "$out/summary.txt"
  timeout 300 wsync tests/bench/cuda_publish.lua 8@0,8,device:8@0,device:8,device:1x8,serial:8,direct-tensor@0,direct-tensor 5 >"$out/cuda_publish.log" 2>&1 || status=1
  grep -v "^trainer rank\|^wsync:\|^  chunk" "$out/cuda_publish.log" | tail -n 24 | tee -a "$out/summary.txt"
fi
if stage host-time; then
  echo "== host time outside copies (tests/bench/publish_bandwidth.lua layout both 12)" | tee -a "$out/summary.txt"
  timeout 120 wsync tests/bench/publish_bandwidth.lua layout both 12 >"$out/host_time.log" 2>&1 || status=1
  grep -E "layout:|^host time" "$out/host_time.log" | tee -a "$out/summary.txt"
fi
if stage offload; then
  echo "== the schedule's torch offloads (tests/bench/offload.py --gb 8)" | tee -a "$out/summary.txt"
  timeout 150 python3 tests/bench/offload.py --gb 8 --json "$out/offload.json" >"$out/offload.log" 2>&1 || status=1
  grep -E "^offload:" "$out/offload.log" | tail -n 8 | tee -a "$out/summary.txt"
fi
if stage host-pinned; then
  echo "== the pinned copy by how its host memory was allocated, and beside a release (tests/bench/host_pinned.py)" | tee -a "$out/summary.txt"
  timeout 120 python3 tests/bench/host_pinned.py >"$out/host_pinned.log" 2>&1 || status=1
  grep -E "^host_pinned:" "$out/host_pinned.log" | tee -a "$out/summary.txt"
fi
if stage vllm || stage vllm-fp8 || stage vllm-faults || stage vllm-memory || stage colocated || stage example || stage vllm-bench || stage rl-step; then
  if [ -f .vllm/activate.sh ]; then
    # (Only now: the tier above runs without vLLM, its vLLM spec pending.)
    # shellcheck source=/dev/null
    source .vllm/activate.sh
    if stage vllm; then
      echo "== vLLM specs (tests/gpu/vllm_spec.lua: vllm_e2e.py direct and native, vllm_faults.py)" \
        | tee -a "$out/summary.txt"
      timeout 540 wsync test tests/gpu/vllm_spec.lua --exclude-tags=faults,fp8 -o utfTerminal >"$out/vllm_spec.log" \
        2>&1 || status=1
      grep -E "^vllm_e2e|^vllm_keep|successes|^(Failure|Error) ->" "$out/vllm_spec.log" | tail -n 40 \
        | tee -a "$out/summary.txt"
    fi
    if stage vllm-fp8; then
      echo "== vLLM FP8 rollout (tests/gpu/vllm_spec.lua #fp8: vllm_e2e.py direct-fp8 and native-fp8)" \
        | tee -a "$out/summary.txt"
      timeout 540 wsync test tests/gpu/vllm_spec.lua --tags=fp8 -o utfTerminal >"$out/vllm_fp8.log" 2>&1 || status=1
      grep -E "^vllm_e2e|successes|^(Failure|Error) ->" "$out/vllm_fp8.log" | tail -n 40 | tee -a "$out/summary.txt"
    fi
    if stage vllm-faults; then
      echo "== vLLM faults (tests/gpu/vllm_faults.py: kills and stops of the trainer, the runtime, EngineCore)" \
        | tee -a "$out/summary.txt"
      timeout 580 python3 tests/gpu/vllm_faults.py >"$out/vllm_faults.log" 2>&1 || status=1
      grep -E "^vllm_faults" "$out/vllm_faults.log" | tail -n 30 | tee -a "$out/summary.txt"
    fi
    if stage vllm-memory; then
      echo "== vLLM's device memory by sleep/wake state (tests/gpu/vllm_memory.py, 1.5 GB model at 0.3)" \
        | tee -a "$out/summary.txt"
      timeout 150 python3 tests/gpu/vllm_memory.py tests/fixtures/models/rl_1p5g --utilization 0.3 \
        --json "$out/vllm_memory.json" >"$out/vllm_memory.log" 2>&1 || status=1
      grep -E "^vllm_memory:|Free memory on device|Sleep mode freed" "$out/vllm_memory.log" | tee -a "$out/summary.txt"
    fi
    if stage colocated; then
      echo "== a model colocated only by the schedule: 10 RL steps, memory and switch (tests/bench/colocated.py)" \
        | tee -a "$out/summary.txt"
      timeout 560 python3 tests/bench/colocated.py --steps "${COLOCATED_STEPS:-10}" --json "$out/colocated.json" \
        >"$out/colocated.log" 2>&1 || status=1
      grep -E "^colocated:|^schedule (switch|memory):" "$out/colocated.log" | tail -n 30 | tee -a "$out/summary.txt"
    fi
    if stage example; then
      echo "== the RL example (bindings/python/examples/grpo.py --steps 50, tests/gpu/rl_example.py)" \
        | tee -a "$out/summary.txt"
      timeout 400 python3 tests/gpu/rl_example.py "$out" >"$out/rl_example.log" 2>&1 || status=1
      grep -E "^rl example: (initial|step (1|10|20|30|40|50)/|generation median|reward )|^rl_example" \
        "$out/rl_example.log" | tail -n 20 | tee -a "$out/summary.txt"
    fi
    if stage vllm-bench; then
      echo "== vLLM: wsync native and direct against vLLM's own weight sync (tests/bench/vllm_publish.py)" \
        | tee -a "$out/summary.txt"
      # (The ways that fit one call beside vLLM's own twice; VLLM_WAYS names others: "fp8
      # direct storage,fp8 native" for issue 24's FP8 line, beside vLLM's own into FP8 only.)
      timeout 540 python3 tests/bench/vllm_publish.py 3 "${VLLM_WAYS:-direct storage,direct 2x4GiB,native}" \
        >"$out/vllm_publish.log" 2>&1 || status=1
      grep -E "^vllm_publish|^way|^floor|^vLLM|^wsync|^\(wsync|^fp8 publish|Error" "$out/vllm_publish.log" | tail -n 30 \
        | tee -a "$out/summary.txt"
    fi
    if stage rl-step; then
      echo "== vLLM: the RL step's publication, engine live (tests/bench/rl_step.py)" | tee -a "$out/summary.txt"
      timeout 540 python3 tests/bench/rl_step.py --json "$out/rl_step.json" >"$out/rl_step.log" 2>&1 || status=1
      grep -vE "step [0-9]+:" "$out/rl_step.log" | grep -E "^rl_step|^model|^(tiny|1\.5GB|30B)|^a rollout|^rl step|Error" \
        | tee -a "$out/summary.txt"
    fi
  else
    echo "== vLLM: not carried (.vllm): its specs stay pending, the RL example and the benchmarks are not run" \
      | tee -a "$out/summary.txt"
  fi
fi
exit $status
