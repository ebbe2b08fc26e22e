// Deterministic synthetic tensor values: the value of element i of tensor
// `name` at model version v is a pure function of (name, i, v), so a trainer,
// a test and a verifier compute the same bytes independently.
#pragma once

#include "dtype.h"
#include "status_defs.h"

#ifndef WS_FFI
#include <stddef.h>
#include <stdint.h>
#endif

/// Returns the 64-bit seed of a tensor name (FNV-1a over its bytes).
uint64_t ws_synth_seed(const char *name, size_t length);

/// Writes elements [first, first + count) of the tensor with `seed` at
/// `version` into `target` (count x element size bytes). Values are finite,
/// of both signs, with magnitudes in [2^-8, 2). Supports bfloat16 and
/// float32.
int ws_synth_fill(void *target, ws_dtype dtype, uint64_t seed, uint64_t first,
                  uint64_t count, uint32_t version);
