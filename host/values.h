// Position-weighted sums of tensor values that compose over any split of a
// tensor's elements: the trainer ranks each sum the elements they hold, a TP
// worker sums what it holds resident, and the sums must add up. They check a
// publication against the trainer's own values (synthetic values have their
// own check, host/synth.h).
//
// Element i (of a resident tensor) with value bits b adds
//   term(seed, i, b) = mix(seed ^ mix(i)) * (2 b + 1)   (mod 2^64)
// to its tensor's sum: a changed, moved or missing element changes the sum
// with probability 1 - 2^-64 or so.
#pragma once

#include "status_defs.h"

#ifndef WS_FFI
#include <stddef.h>
#include <stdint.h>
#endif

/// One strided region of a source byte space S: `rows` rows of `width`
/// bytes, row k at S-bytes [first + k pitch, + width). Only the S-bytes in
/// [lo, hi) are summed (the part of a canonical tensor one rank holds). S-byte
/// x lies at byte `bias + x` of the memory. Its elements count as indices
/// `index_first + k index_pitch + j` of the tensor whose sum is `sums[slot]`,
/// under that tensor's `seed`.
typedef struct ws_values_op {
  int64_t bias;
  uint64_t first;
  uint64_t rows;
  uint64_t width;
  uint64_t pitch;
  uint64_t lo;
  uint64_t hi;
  uint64_t index_first;
  uint64_t index_pitch;
  uint64_t seed;
  uint64_t slot;
} ws_values_op;

/// Adds the terms of every op's elements (`element_size` bytes each: 1, 2, 4
/// or 8; offsets, widths, pitches and bounds in whole elements) to
/// `sums[op.slot]` (`slot_count` of them). Checks every op first (its bytes
/// within the memory's `size`, its slot below `slot_count`); nothing is
/// summed when one is wrong, and the detail names the op.
int ws_values_sum(const void *memory, size_t size, size_t element_size,
                  const ws_values_op *ops, size_t count, uint64_t *sums,
                  size_t slot_count);

/// The 64-bit seed of a tensor name (as ws_synth_seed: FNV-1a).
uint64_t ws_values_seed(const char *name, size_t length);
