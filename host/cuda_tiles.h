// The tiled copy layout's arithmetic, shared by its kernel
// (host/cuda_kernels.cu) and the host's run of the same walk for tests
// (ws_cuda_copy_tiles_on_host): not part of ffi.h.
//
// A tiled plan's descriptors lie in stream order: descriptor i covers bytes
// [starts[i], starts[i + 1]) of the copy stream (its rows one after the
// other). The stream is cut into tiles of `tile` bytes, and warp w of W takes
// tiles w, w + W, w + 2W, ...: at any moment the warps work on neighbouring
// bytes, as a flat device copy does.
#pragma once

#include "cuda_plan.h"

#include <stdint.h>

#ifdef __CUDACC__
#define WS_CUDA_TILE_FN __host__ __device__ __forceinline__
#else
#define WS_CUDA_TILE_FN static inline
#endif

/// Cuts bytes [from, to) of `desc`'s stream into at most three descriptors:
/// the end of a partial first row, the whole rows, the start of a partial last
/// row (one descriptor when the bytes lie in one row or `desc` is one row).
/// Returns how many it wrote to `parts`.
WS_CUDA_TILE_FN unsigned ws_cuda_tile_parts(const ws_cuda_copy_desc *desc,
                                            uint64_t from, uint64_t to,
                                            ws_cuda_copy_desc parts[3]) {
  if (from >= to)
    return 0;
  if (desc->rows <= 1) {
    parts[0].source = desc->source + from;
    parts[0].target = desc->target + from;
    parts[0].source_pitch = parts[0].target_pitch = to - from;
    parts[0].rows = 1;
    parts[0].width = (uint32_t)(to - from);
    return 1;
  }
  const uint64_t width = desc->width;
  uint64_t row = from / width, column = from - row * width;
  const uint64_t last_row = to / width, last_column = to - last_row * width;
  unsigned count = 0;
  if (row == last_row || column != 0) {
    // (One row's part: the bytes end in this row, or its end is whole.)
    uint64_t end = row == last_row ? last_column : width;
    ws_cuda_copy_desc *part = &parts[count++];
    part->source = desc->source + row * desc->source_pitch + column;
    part->target = desc->target + row * desc->target_pitch + column;
    part->source_pitch = part->target_pitch = end - column;
    part->rows = 1;
    part->width = (uint32_t)(end - column);
    if (row == last_row)
      return count;
    row++;
  }
  if (last_row > row) {
    ws_cuda_copy_desc *part = &parts[count++];
    part->source = desc->source + row * desc->source_pitch;
    part->target = desc->target + row * desc->target_pitch;
    part->source_pitch = desc->source_pitch;
    part->target_pitch = desc->target_pitch;
    part->rows = (uint32_t)(last_row - row);
    part->width = (uint32_t)width;
  }
  if (last_column != 0) {
    ws_cuda_copy_desc *part = &parts[count++];
    part->source = desc->source + last_row * desc->source_pitch;
    part->target = desc->target + last_row * desc->target_pitch;
    part->source_pitch = part->target_pitch = last_column;
    part->rows = 1;
    part->width = (uint32_t)last_column;
  }
  return count;
}
