#include "synth.h"

#include "hash.h"
#include "status.h"

#include <string.h>

uint64_t ws_synth_seed(const char *name, size_t length) {
  return ws_hash_name(name, length);
}

// float32 bits: random sign, exponent in [119, 127] (2^-8 .. < 2), random
// mantissa.
static uint32_t float_bits(uint64_t bits) {
  uint32_t sign = (uint32_t)(bits >> 63) << 31;
  uint32_t exponent = 119u + (uint32_t)((bits >> 40) % 9u);
  uint32_t mantissa = (uint32_t)bits & 0x7fffffu;
  return sign | (exponent << 23) | mantissa;
}

int ws_synth_fill(void *target, ws_dtype dtype, uint64_t seed, uint64_t first,
                  uint64_t count, uint32_t version) {
  ws_clear_error();
  uint64_t key = ws_hash_mix(seed ^ ws_hash_version(version));
  switch (dtype) {
  case WS_DTYPE_BFLOAT16: {
    uint16_t *out = target;
    for (uint64_t i = 0; i < count; i++)
      out[i] = (uint16_t)(float_bits(ws_hash_mix(key + first + i)) >> 16);
    return WS_OK;
  }
  case WS_DTYPE_FLOAT32: {
    uint32_t *out = target;
    for (uint64_t i = 0; i < count; i++)
      out[i] = float_bits(ws_hash_mix(key + first + i));
    return WS_OK;
  }
  default:
    return ws_fail(WS_EINVAL, "synth: dtype %s is not generated (bfloat16, "
                              "float32)",
                   ws_dtype_name(dtype) ? ws_dtype_name(dtype) : "?");
  }
}
