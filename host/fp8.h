// FP8 quantization of bfloat16 weights as vLLM 0.26 quantizes a bfloat16
// checkpoint online (quantization = "fp8", per tensor): the host's reference
// of the transform step of a direct load, bitwise what vLLM's kernels and
// wsync's (host/cuda_kernels.cu) write. Read in
// bindings/python/wsync/vllm/FP8.md, section 3.1:
//
// - a group (the rank-local fused qkv of a layer, o_proj, the router, one
//   expert's gate and up together, one expert's down) has one float32 scale
//   s = amax / 448, amax the largest |x| of its elements as float32 (NaN
//   elements are passed over; no lower bound: an all-zero group has s = 0);
// - every element becomes RNE_satfinite(clamp(x * (1.0f / s), -448, 448)) in
//   float8_e4m3fn. With s = 0 the product is NaN for a zero, which the clamp
//   turns into +448 (0x7e): the weight still dequantizes to 0.
#pragma once

#include "status_defs.h"

#ifndef WS_FFI
#include <stddef.h>
#include <stdint.h>
#endif

enum {
  WS_FP8_E4M3_MAX = 448,          // the largest finite float8_e4m3fn
  WS_FP8_GROUPS_MAX = 1 << 24,    // groups of one transform at most
};

/// One group's scale: the float32 at byte `scale_offset` of target (or, on
/// the device, region) `target`.
typedef struct ws_fp8_group {
  uint64_t target;
  uint64_t scale_offset;
} ws_fp8_group;

/// One strided piece of a group: `rows` rows of `columns` bfloat16 elements
/// from `source_offset` in source (region) `source` (rows `source_pitch`
/// bytes apart) quantized to `rows` rows of `columns` float8_e4m3fn bytes at
/// `target_offset` in target (region) `target` (rows `target_pitch` apart),
/// under the scale of group `group`.
typedef struct ws_fp8_op {
  uint64_t group;
  uint64_t target;
  uint64_t source;
  uint64_t target_offset;
  uint64_t source_offset;
  uint64_t rows;
  uint64_t columns;
  uint64_t target_pitch;
  uint64_t source_pitch;
} ws_fp8_op;

/// The float8_e4m3fn bits of `value`, rounded to nearest, ties to even, with
/// saturation: a magnitude past 448 (infinity included) gives +-448; NaN
/// gives 0x7f.
uint8_t ws_fp8_e4m3_from_float(float value);

/// The float value of float8_e4m3fn bits (0x7f and 0xff: NaN).
float ws_fp8_e4m3_to_float(uint8_t bits);

/// The scale of a group whose largest magnitude is `amax`: amax / 448.
float ws_fp8_scale(float amax);

/// One element under scale `scale`, as vLLM's kernel writes it: x times
/// 1.0f / scale, clamped to +-448, then converted.
uint8_t ws_fp8_quantize(float value, float scale);

/// Checks every op and group against the targets and sources (their bytes in
/// range, their indices below the counts, every group with an op), then, for
/// each group, computes its scale over all its ops' elements, writes it, and
/// quantizes its ops' elements into their targets. Nothing is written when
/// any op or group is wrong; the detail names it.
int ws_fp8_run(void *const *targets, const size_t *target_sizes,
               size_t target_count, const void *const *sources,
               const size_t *source_sizes, size_t source_count,
               const ws_fp8_group *groups, size_t group_count,
               const ws_fp8_op *ops, size_t count);

/// Checks `ops` and `groups` against regions of `target_sizes` and
/// `source_sizes` bytes, as ws_fp8_run does before it writes anything (the
/// device's plan checks them the same way, host/cuda_plan.c).
int ws_fp8_check(const size_t *target_sizes, size_t target_count,
                 const size_t *source_sizes, size_t source_count,
                 const ws_fp8_group *groups, size_t group_count,
                 const ws_fp8_op *ops, size_t count);
