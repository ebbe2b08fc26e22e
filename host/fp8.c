#include "fp8.h"

#include "status.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint32_t bits_of(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  return bits;
}

static float float_of(uint32_t bits) {
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

uint8_t ws_fp8_e4m3_from_float(float value) {
  uint32_t bits = bits_of(value);
  uint8_t sign = (uint8_t)((bits >> 31) << 7);
  if (isnan(value))
    return 0x7f;
  float magnitude = fabsf(value);
  if (magnitude >= (float)WS_FP8_E4M3_MAX)
    return sign | 0x7e;
  if (magnitude < 0x1p-6f) {
    // Subnormal: multiples of 2^-9 (the product is exact; 8 of them is the
    // smallest normal, 0x08, which the encoding continues into).
    return sign | (uint8_t)rintf(magnitude * 512.0f);
  }
  // Normal: keep 3 of the 23 mantissa bits, ties to even; a carry out of
  // the mantissa moves into the exponent, as the encoding's order allows.
  uint32_t magnitude_bits = bits & 0x7fffffffu;
  int exponent = (int)(magnitude_bits >> 23) - 127;
  uint32_t kept = (magnitude_bits >> 20) & 7u, rest = magnitude_bits & 0xfffffu;
  uint32_t code = ((uint32_t)(exponent + 7) << 3) + kept;
  if (rest > 0x80000u || (rest == 0x80000u && (kept & 1u)))
    code++;
  return sign | (uint8_t)(code > 0x7e ? 0x7e : code);
}

float ws_fp8_e4m3_to_float(uint8_t bits) {
  float sign = (bits & 0x80) ? -1.0f : 1.0f;
  unsigned exponent = (bits >> 3) & 15u, mantissa = bits & 7u;
  if (exponent == 15 && mantissa == 7)
    return NAN;
  if (exponent == 0)
    return sign * ldexpf((float)mantissa, -9);
  return sign * ldexpf((float)(8 + mantissa), (int)exponent - 10);
}

float ws_fp8_scale(float amax) { return amax / (float)WS_FP8_E4M3_MAX; }

// One element under the reciprocal of its group's scale.
static uint8_t quantize_inverse(float value, float inverse) {
  float scaled = value * inverse;
  float clamped = fmaxf(-(float)WS_FP8_E4M3_MAX,
                        fminf(scaled, (float)WS_FP8_E4M3_MAX));
  return ws_fp8_e4m3_from_float(clamped);
}

uint8_t ws_fp8_quantize(float value, float scale) {
  return quantize_inverse(value, 1.0f / scale);
}

static float bfloat16_at(const uint8_t *at) {
  uint16_t bits;
  memcpy(&bits, at, sizeof bits);
  return float_of((uint32_t)bits << 16);
}

// True when `rows` rows of `width` bytes, `pitch` apart from `offset`, lie in
// `size` bytes without overlapping one another.
static int span_inside(uint64_t offset, uint64_t rows, uint64_t width,
                       uint64_t pitch, uint64_t size) {
  if (offset > size)
    return 0;
  if (rows == 0 || width == 0)
    return 1;
  if (rows > 1 && (pitch < width || rows - 1 > (UINT64_MAX - width) / pitch))
    return 0;
  return (rows - 1) * pitch + width <= size - offset;
}

int ws_fp8_check(const size_t *target_sizes, size_t target_count,
                 const size_t *source_sizes, size_t source_count,
                 const ws_fp8_group *groups, size_t group_count,
                 const ws_fp8_op *ops, size_t count) {
  if (group_count > WS_FP8_GROUPS_MAX)
    return ws_fail(WS_EINVAL, "fp8: %zu groups (at most %d)", group_count,
                   WS_FP8_GROUPS_MAX);
  if ((count > 0 && ops == NULL) || (group_count > 0 && groups == NULL))
    return ws_fail(WS_EINVAL, "fp8: %zu ops and %zu groups, not all in arrays",
                   count, group_count);
  for (size_t g = 0; g < group_count; g++) {
    if (groups[g].target >= target_count)
      return ws_fail(WS_EINVAL, "fp8 group %zu: its scale's target %llu of %zu",
                     g, (unsigned long long)groups[g].target, target_count);
    if (!span_inside(groups[g].scale_offset, 1, sizeof(float), sizeof(float),
                     target_sizes[groups[g].target]))
      return ws_fail(WS_EINVAL,
                     "fp8 group %zu: its float32 scale at byte %llu exceeds "
                     "target %llu (%zu bytes)",
                     g, (unsigned long long)groups[g].scale_offset,
                     (unsigned long long)groups[g].target,
                     target_sizes[groups[g].target]);
  }
  uint8_t *used = calloc(group_count > 0 ? group_count : 1, 1);
  if (used == NULL)
    return ws_fail(WS_ENOMEM, "fp8: %zu groups", group_count);
  int status = WS_OK;
  for (size_t i = 0; i < count && status == WS_OK; i++) {
    const ws_fp8_op *op = &ops[i];
    if (op->group >= group_count || op->target >= target_count ||
        op->source >= source_count)
      status = ws_fail(WS_EINVAL,
                       "fp8 op %zu: group %llu, target %llu, source %llu of "
                       "%zu, %zu, %zu",
                       i, (unsigned long long)op->group,
                       (unsigned long long)op->target,
                       (unsigned long long)op->source, group_count,
                       target_count, source_count);
    else if (op->columns > UINT64_MAX / 2 ||
             !span_inside(op->source_offset, op->rows, op->columns * 2,
                          op->source_pitch, source_sizes[op->source]) ||
             !span_inside(op->target_offset, op->rows, op->columns,
                          op->target_pitch, target_sizes[op->target]))
      status = ws_fail(WS_EINVAL,
                       "fp8 op %zu: %llu rows x %llu elements from byte %llu "
                       "(pitch %llu) of source %llu to byte %llu (pitch %llu) "
                       "of target %llu exceed them",
                       i, (unsigned long long)op->rows,
                       (unsigned long long)op->columns,
                       (unsigned long long)op->source_offset,
                       (unsigned long long)op->source_pitch,
                       (unsigned long long)op->source,
                       (unsigned long long)op->target_offset,
                       (unsigned long long)op->target_pitch,
                       (unsigned long long)op->target);
    else
      used[op->group] = 1;
  }
  for (size_t g = 0; g < group_count && status == WS_OK; g++)
    if (!used[g])
      status = ws_fail(WS_EINVAL, "fp8 group %zu has no op: its scale would "
                                  "cover nothing",
                       g);
  free(used);
  return status;
}

int ws_fp8_run(void *const *targets, const size_t *target_sizes,
               size_t target_count, const void *const *sources,
               const size_t *source_sizes, size_t source_count,
               const ws_fp8_group *groups, size_t group_count,
               const ws_fp8_op *ops, size_t count) {
  ws_clear_error();
  int status = ws_fp8_check(target_sizes, target_count, source_sizes,
                            source_count, groups, group_count, ops, count);
  if (status != WS_OK)
    return status;
  float *amax = calloc(group_count > 0 ? group_count : 1, sizeof *amax);
  if (amax == NULL)
    return ws_fail(WS_ENOMEM, "fp8: %zu groups", group_count);
  for (size_t i = 0; i < count; i++) {
    const ws_fp8_op *op = &ops[i];
    const uint8_t *source = (const uint8_t *)sources[op->source] +
                            op->source_offset;
    float largest = amax[op->group];
    for (uint64_t row = 0; row < op->rows; row++)
      for (uint64_t column = 0; column < op->columns; column++)
        largest = fmaxf(largest, fabsf(bfloat16_at(
                                     source + row * op->source_pitch +
                                     column * 2)));
    amax[op->group] = largest;
  }
  for (size_t g = 0; g < group_count; g++) {
    float scale = ws_fp8_scale(amax[g]);
    memcpy((uint8_t *)targets[groups[g].target] + groups[g].scale_offset,
           &scale, sizeof scale);
    amax[g] = 1.0f / scale; // (from here on, the group's reciprocal)
  }
  for (size_t i = 0; i < count; i++) {
    const ws_fp8_op *op = &ops[i];
    const uint8_t *source = (const uint8_t *)sources[op->source] +
                            op->source_offset;
    uint8_t *target = (uint8_t *)targets[op->target] + op->target_offset;
    float inverse = amax[op->group];
    for (uint64_t row = 0; row < op->rows; row++)
      for (uint64_t column = 0; column < op->columns; column++)
        target[row * op->target_pitch + column] = quantize_inverse(
            bfloat16_at(source + row * op->source_pitch + column * 2),
            inverse);
  }
  free(amax);
  return WS_OK;
}
