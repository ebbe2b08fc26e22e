// Batched device copies and synthetic fills of the cuda backend: one kernel
// launch per chunk, whatever its tensor count.
//
// A plan is built once (per chunk, per session) from ops that address regions
// by offset: every op is checked against its regions on the host, then the
// ops become descriptors with absolute device pointers, split so that the
// bytes spread evenly over the warps the device holds at once (one huge op and
// 10,000 tiny ones both fill every SM), uploaded to the device once, and
// launched as often as needed on a stream. Each warp loads a batch of 32
// descriptors at a time and copies with 16-byte loads and stores when both
// addresses, the width and the pitches allow (8, 4, 2 or 1 bytes otherwise;
// a contiguous piece whose ends are misaligned alike copies its head and tail
// bytewise and its body 16 bytes at a time). A tiled plan
// (ws_cuda_copy_plan_create_tiled) keeps the ops whole in stream order
// instead, and every warp takes fixed-size tiles of the stream in turn, so
// that the warps work on neighbouring bytes (host/cuda_tiles.h).
//
// Synthetic plans write (or check) wsync's synthetic values (synth.h) on the
// device: bitwise what ws_synth_fill writes, for bfloat16 and float32.
//
// FP8 plans are a load's transform step (quantization = "fp8"): groups of
// strided bfloat16 pieces quantized to float8_e4m3fn under one float32 scale
// per group, as vLLM's per-tensor kernels do, bitwise what the host's
// reference (fp8.h, ws_fp8_run) writes. The ops are those of fp8.h with
// region indices for targets and sources; a launch zeroes the groups' amax,
// runs one kernel for the amax of every group and one that writes every
// scale and quantizes every piece.
#pragma once

#include "copy_defs.h"
#include "cuda_memory.h"
#include "fp8.h"
#include "status_defs.h"

#ifndef WS_FFI
#include <stddef.h>
#include <stdint.h>
#endif

/// One strided copy between two regions: `rows` rows of `width` bytes from
/// `source_offset` in region `source_region` (advancing `source_pitch` bytes
/// per row) to `target_offset` in `target_region` (advancing `target_pitch`).
/// Regions are indices into the plan's region array.
typedef struct ws_cuda_copy_op {
  uint32_t target_region;
  uint32_t source_region;
  WS_STRIDED_COPY_FIELDS
} ws_cuda_copy_op;

/// One descriptor as the kernel reads it: absolute device pointers, at most
/// WS_CUDA_PIECE_MAX bytes.
typedef struct ws_cuda_copy_desc {
  uint64_t source;
  uint64_t target;
  uint64_t source_pitch;
  uint64_t target_pitch;
  uint32_t rows;
  uint32_t width;
} ws_cuda_copy_desc;

/// Elements of a synthetic tensor written to (or checked in) a region: `rows`
/// rows of `row_elements` elements, row k at `offset + k * target_pitch` bytes
/// holding tensor elements `first + k * element_pitch` onwards. A TP slice of
/// a canonical tensor is one op; a contiguous range is one row.
typedef struct ws_cuda_synth_op {
  uint32_t region;
  uint32_t dtype; // ws_dtype: WS_DTYPE_BFLOAT16 or WS_DTYPE_FLOAT32
  uint64_t offset;
  uint64_t rows;
  uint64_t row_elements;
  uint64_t target_pitch;  // bytes
  uint64_t first;         // tensor element index of the first element
  uint64_t element_pitch; // tensor elements between rows
  uint64_t seed;          // ws_synth_seed of the tensor's name
} ws_cuda_synth_op;

/// One copy of `bytes` contiguous bytes between absolute device pointers,
/// which CUDA's own device-to-device copy runs (cudaMemcpyAsync, as torch's
/// copy_ of one tensor does): a plan's bulk copies.
typedef struct ws_cuda_bulk_copy {
  uint64_t source;
  uint64_t target;
  uint64_t bytes;
} ws_cuda_bulk_copy;

/// How a copy plan runs its ops. `tile`: the tiled layout's tile (0: per-warp
/// ranges). `bulk`: runs of ops that continue one another contiguously (the
/// next op's source and target start where the previous op's end, in the same
/// regions) are joined into one op, and a joined run of at least `bulk` bytes
/// is a bulk copy rather than part of the kernel's launch (0: neither).
typedef struct ws_cuda_copy_options {
  uint64_t tile;
  uint64_t bulk;
} ws_cuda_copy_options;

/// What a plan holds, for reports and tests.
typedef struct ws_cuda_plan_info {
  uint64_t ops;
  uint64_t pieces;        // descriptors
  uint64_t warps;         // warps the launch spreads them over
  uint64_t tile;          // bytes per tile of a tiled plan (0: per-warp ranges)
  uint64_t blocks;        // thread blocks of one launch
  uint64_t bytes;         // bytes one launch writes
  uint64_t device_bytes;  // device memory the plan holds (descriptors)
  uint64_t bulk;          // bulk copies (ws_cuda_copy_options)
  uint64_t bulk_bytes;    // bytes of them
} ws_cuda_plan_info;

/// The outcome of a synthetic check: mismatching elements, and the first one
/// (lowest op, then lowest tensor element index) when there is any.
typedef struct ws_cuda_synth_result {
  uint64_t mismatches;
  uint64_t first_op;
  uint64_t first_element;
} ws_cuda_synth_result;

enum {
  WS_CUDA_PIECE_MAX = 1 << 30,   // bytes of one descriptor at most
  WS_CUDA_WARP_MIN_BYTES = 256,  // a warp gets at least this much to copy
  WS_CUDA_OPS_MAX = 1 << 24,     // ops of one plan at most
  WS_CUDA_TILE_UNIT = 512,       // a tile is a multiple of this (32 lanes x 16 bytes)
  WS_CUDA_TILE_MAX = 1 << 26,    // bytes of one tile at most
};

/// One piece of an FP8 plan as its kernels read it: at most
/// WS_CUDA_FP8_PIECE_ELEMENTS elements of one op (whole rows of it, or part
/// of one row), with absolute device pointers.
typedef struct ws_cuda_fp8_piece {
  uint64_t source;
  uint64_t target;
  uint64_t source_pitch; // bytes
  uint64_t target_pitch; // bytes
  uint32_t rows;
  uint32_t columns;
  uint32_t group;
  uint32_t op;
} ws_cuda_fp8_piece;

enum {
  WS_CUDA_FP8_PIECE_ELEMENTS = 1 << 16, // elements of one FP8 piece at most
};

typedef struct ws_cuda_copy_plan ws_cuda_copy_plan;
typedef struct ws_cuda_synth_plan ws_cuda_synth_plan;
typedef struct ws_cuda_fp8_plan ws_cuda_fp8_plan;

/// Checks every op against its regions (nothing else runs when one is out of
/// range; the detail names the op) and lays the ops out as descriptors for
/// `warps` warps, without touching a device. With `descs` NULL it only counts:
/// `*desc_count` and `*warps_used` tell the sizes of `descs` and of
/// `warp_start` (warps_used + 1 entries: warp w runs descriptors
/// warp_start[w] .. warp_start[w + 1] - 1). ws_cuda_copy_plan_create uses it;
/// tests run it on host memory.
int ws_cuda_copy_layout(const ws_cuda_region *regions, size_t region_count,
                        const ws_cuda_copy_op *ops, size_t count,
                        uint32_t warps, ws_cuda_copy_desc *descs,
                        size_t capacity, size_t *desc_count,
                        uint32_t *warp_start, uint32_t *warps_used);

/// The tiled layout of the same ops: descriptors in stream order (each op
/// cut only where a descriptor's size limit ends it) and where each starts
/// in the stream, `starts` (desc_count + 1 entries, the last the total), for
/// a kernel whose warps take tiles of the stream in turn (host/cuda_tiles.h).
/// With `descs` NULL it only counts. Checks the ops as ws_cuda_copy_layout.
int ws_cuda_copy_tile_layout(const ws_cuda_region *regions,
                             size_t region_count, const ws_cuda_copy_op *ops,
                             size_t count, ws_cuda_copy_desc *descs,
                             size_t capacity, size_t *desc_count,
                             uint64_t *starts);

/// Orders the ops by where they write, joins runs of ops that continue one
/// another and sets apart the runs of at least `min_bytes` as bulk copies
/// (ws_cuda_copy_options.bulk; 0 copies the ops to `rest` unchanged). `rest` and `bulk` have room for `count` entries
/// each; `*rest_count` and `*bulk_count` say how many were written. Checks the
/// ops as ws_cuda_copy_layout; the copies `rest` and `bulk` make together are
/// exactly the ops'. Tests run it on host memory.
int ws_cuda_copy_split_bulk(const ws_cuda_region *regions, size_t region_count,
                            const ws_cuda_copy_op *ops, size_t count,
                            uint64_t min_bytes, ws_cuda_copy_op *rest,
                            size_t *rest_count, ws_cuda_bulk_copy *bulk,
                            size_t *bulk_count);

/// Runs a tiled layout's copies on the host, walking the tiles as `warps`
/// warps of the kernel do (each warp its tiles, in turn): for tests of the
/// walk on host memory. `tile` as ws_cuda_copy_plan_create_tiled's.
int ws_cuda_copy_tiles_on_host(const ws_cuda_copy_desc *descs,
                               const uint64_t *starts, size_t count,
                               uint64_t tile, uint32_t warps);

/// Builds a copy plan on `device`: checks the ops (ws_cuda_copy_layout) and
/// that every region is device memory of `device` lying inside one
/// allocation, then uploads the descriptors once.
int ws_cuda_copy_plan_create(int device, const ws_cuda_region *regions,
                             size_t region_count, const ws_cuda_copy_op *ops,
                             size_t count, ws_cuda_copy_plan **out);

/// The same with the tiled layout (ws_cuda_copy_tile_layout): every warp the
/// device holds at once takes tiles of `tile` bytes of the copy stream in
/// turn (a multiple of WS_CUDA_TILE_UNIT, at most WS_CUDA_TILE_MAX).
int ws_cuda_copy_plan_create_tiled(int device, const ws_cuda_region *regions,
                                   size_t region_count,
                                   const ws_cuda_copy_op *ops, size_t count,
                                   uint64_t tile, ws_cuda_copy_plan **out);

/// The same with `options` (NULL: per-warp ranges, no bulk copies).
int ws_cuda_copy_plan_create_with(int device, const ws_cuda_region *regions,
                                  size_t region_count,
                                  const ws_cuda_copy_op *ops, size_t count,
                                  const ws_cuda_copy_options *options,
                                  ws_cuda_copy_plan **out);

/// Queues the plan's bulk copies and its one kernel launch on `stream` (NULL:
/// legacy default stream). Completion: an event recorded after them, or the
/// stream's sync.
int ws_cuda_copy_plan_launch(ws_cuda_copy_plan *plan, ws_cuda_stream *stream);

/// Describes the plan.
void ws_cuda_copy_plan_info(const ws_cuda_copy_plan *plan,
                            ws_cuda_plan_info *out);

/// Frees the plan's device memory and the object; NULL is accepted. Launches
/// still queued must have finished (the caller synchronizes first).
int ws_cuda_copy_plan_close(ws_cuda_copy_plan *plan);

/// Builds a synthetic plan on `device`: checks every op (its dtype, its range,
/// element alignment) and every region, then uploads the descriptors once.
int ws_cuda_synth_plan_create(int device, const ws_cuda_region *regions,
                              size_t region_count, const ws_cuda_synth_op *ops,
                              size_t count, ws_cuda_synth_plan **out);

/// Queues one launch that writes every op's values at model `version`.
int ws_cuda_synth_plan_fill(ws_cuda_synth_plan *plan, uint32_t version,
                            ws_cuda_stream *stream);

/// Queues one launch that compares every op's elements with their values at
/// `version`; ws_cuda_synth_plan_result gives the outcome.
int ws_cuda_synth_plan_check(ws_cuda_synth_plan *plan, uint32_t version,
                             ws_cuda_stream *stream);

/// Waits (without spinning) for the last check and stores its outcome.
int ws_cuda_synth_plan_result(ws_cuda_synth_plan *plan,
                              ws_cuda_synth_result *out);

/// Describes the plan (bytes: the bytes one launch writes or reads).
void ws_cuda_synth_plan_info(const ws_cuda_synth_plan *plan,
                             ws_cuda_plan_info *out);

/// Frees the plan's device and pinned memory and the object; NULL is
/// accepted. Launches still queued must have finished.
int ws_cuda_synth_plan_close(ws_cuda_synth_plan *plan);

/// Checks an FP8 transform against its regions (ws_fp8_check with the
/// regions' sizes for targets and sources alike; every bfloat16 source
/// 2-byte aligned and every scale 4-byte aligned at its address) and cuts
/// its ops into pieces (at most WS_CUDA_FP8_PIECE_ELEMENTS elements each, in
/// op order, without touching a device. With `pieces` NULL it only counts
/// (`*piece_count`). ws_cuda_fp8_plan_create uses it; tests run it on host
/// memory.
int ws_cuda_fp8_layout(const ws_cuda_region *regions, size_t region_count,
                       const ws_fp8_group *groups, size_t group_count,
                       const ws_fp8_op *ops, size_t count,
                       ws_cuda_fp8_piece *pieces, size_t capacity,
                       size_t *piece_count);

/// Builds an FP8 plan on `device`: checks and lays out the transform
/// (ws_cuda_fp8_layout), checks that every region it uses is device memory
/// of `device` inside one allocation, then uploads the pieces, the groups'
/// scale addresses and room for their amax once.
int ws_cuda_fp8_plan_create(int device, const ws_cuda_region *regions,
                            size_t region_count, const ws_fp8_group *groups,
                            size_t group_count, const ws_fp8_op *ops,
                            size_t count, ws_cuda_fp8_plan **out);

/// Queues the plan's transform on `stream` (NULL: legacy default stream):
/// the amax of every group, then every scale and float8 element.
int ws_cuda_fp8_plan_launch(ws_cuda_fp8_plan *plan, ws_cuda_stream *stream);

/// Describes the plan (ops, pieces, warps, blocks; bytes: what one launch
/// writes, float8 elements and scales; device_bytes: its own memory).
void ws_cuda_fp8_plan_info(const ws_cuda_fp8_plan *plan,
                           ws_cuda_plan_info *out);

/// Frees the plan's device memory and the object; NULL is accepted. Launches
/// still queued must have finished.
int ws_cuda_fp8_plan_close(ws_cuda_fp8_plan *plan);
