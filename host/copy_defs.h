// What the host's copy ops (copy.h) and the cuda backend's (cuda_plan.h)
// share: the fields that place one strided copy.
#pragma once

#ifndef WS_FFI
#include <stdint.h>
#endif

// The fields of an op that copies `rows` rows of `width` bytes from
// `source_offset` in its source (advancing `source_pitch` bytes per row) to
// `target_offset` in its target (advancing `target_pitch`); a contiguous copy
// is one row. Both ops' structs hold them in this order.
#define WS_STRIDED_COPY_FIELDS                                                 \
  uint64_t target_offset;                                                      \
  uint64_t source_offset;                                                      \
  uint64_t rows;                                                               \
  uint64_t width;                                                              \
  uint64_t target_pitch;                                                       \
  uint64_t source_pitch;
