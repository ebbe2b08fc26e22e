// Batched strided copies between two mapped buffers: the data plane's per-chunk
// work on the host backend (all-gather of shards into packed buffers, TP
// slices from a packed buffer into resident storage).
#pragma once

#include "copy_defs.h"
#include "status_defs.h"

#ifndef WS_FFI
#include <stddef.h>
#include <stdint.h>
#endif

/// One strided copy: `rows` rows of `width` bytes, from `source_offset` in
/// the source (advancing `source_pitch` bytes per row) to `target_offset` in
/// the target (advancing `target_pitch`). A contiguous copy is one row.
/// `source` picks the source of ws_copy_run_sources (0 everywhere else).
typedef struct ws_copy_op {
  WS_STRIDED_COPY_FIELDS
  uint64_t source;
} ws_copy_op;

/// Checks every op against both buffers' sizes, then runs them in order.
/// Nothing is copied when any op is out of range; the detail names the op.
int ws_copy_run(void *target, size_t target_size, const void *source,
                size_t source_size, const ws_copy_op *ops, size_t count);

enum { WS_COPY_TARGETS_MAX = 64 };

/// Runs the same ops from one source into each of `target_count` targets of
/// `target_sizes` bytes (the host backend's all-gather: a rank's shard goes to
/// every rank's buffer, read from memory once). Checks every op against the
/// source and every target first; nothing is copied when one is out of range.
int ws_copy_run_targets(void *const *targets, const size_t *target_sizes,
                        size_t target_count, const void *source,
                        size_t source_size, const ws_copy_op *ops,
                        size_t count);

enum { WS_COPY_SOURCES_MAX = 1 << 20 };

/// Runs ops that read from several sources into each of `target_count`
/// targets (one call per chunk, whatever the number of trainer tensors and
/// their memories): op i reads source `ops[i].source` of `source_count`.
/// Checks every op against its source and every target first; nothing is
/// copied when one is out of range.
int ws_copy_run_sources(void *const *targets, const size_t *target_sizes,
                        size_t target_count, void *const *sources,
                        const size_t *source_sizes, size_t source_count,
                        const ws_copy_op *ops, size_t count);

/// Faults in the pages of `size` bytes at `target` for writing now, so that
/// the first copy into fresh memory takes no page fault per page. The bytes
/// are kept. Fails with WS_ENOMEM when the memory is not there.
int ws_copy_prefault(void *target, size_t size);

/// Sums the bytes the ops move (rows x width each).
uint64_t ws_copy_bytes(const ws_copy_op *ops, size_t count);
