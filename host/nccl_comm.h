// NCCL among the trainer ranks of the cuda backend, loaded lazily with
// dlopen("libnccl.so.2") ($WSYNC_NCCL_LIBRARY names another file): wsync
// starts and runs the host backend on a machine without NCCL; asking for NCCL
// there fails with WS_ENODEV naming the library and the loader's reason.
//
// The fill of a chunk is one NCCL group: for every tensor slot and every rank
// r, a broadcast rooted at r of r's dim-0 rows straight into the slot at r's
// row offset in every rank's packed buffer (shards may be uneven, so one
// broadcast per root rather than one all-gather). With one rank the fill is a
// copy plan (cuda_plan.h) instead. Every NCCL call is checked; a failure's
// detail names the call and NCCL's own result name ("ncclCommInitRank:
// ncclInvalidArgument (...)").
#pragma once

#include "cuda_memory.h"
#include "status_defs.h"

#ifndef WS_FFI
#include <stddef.h>
#include <stdint.h>
#endif

enum { WS_NCCL_UNIQUE_ID_BYTES = 128 };

typedef struct ws_nccl_comm ws_nccl_comm;

/// One root's rows of one tensor slot in a fill group. Every rank passes the
/// same list; `source_*` is read on the root only.
typedef struct ws_nccl_broadcast {
  uint64_t target_offset; // where the root's rows go in every packed buffer
  uint64_t bytes;         // bytes of the root's rows (0: skipped everywhere)
  uint64_t source_offset; // on the root: offset in its source region
  uint32_t source_region; // on the root: index into the source regions
  int32_t root;
} ws_nccl_broadcast;

/// Returns 1 when this build carries the NCCL path (with the cuda backend;
/// NCCL itself is loaded at run time), 0 otherwise.
int ws_nccl_built(void);

/// Loads NCCL once per process; later calls answer the first outcome.
int ws_nccl_load(void);

/// Stores NCCL's version code (e.g. 22809 for 2.28.9) in `*version`.
int ws_nccl_version(int *version);

/// Writes a new 128-byte ncclUniqueId into `id_out`, for rank 0 to hand to
/// the others through the host.
int ws_nccl_unique_id(unsigned char *id_out);

/// Joins communicator `id` as `rank` of `world` on `device`. Blocking (the
/// call returns once every rank joined) unless `nonblocking`, in which case
/// ws_nccl_comm_ready says when it has, so that a deadline can abort it.
int ws_nccl_comm_init(int device, int world, int rank,
                      const unsigned char *id, int nonblocking,
                      ws_nccl_comm **out);

/// Stores 1 in `*ready` once the communicator's last operation (its init, a
/// nonblocking group) is done, 0 while it is in progress; fails with the
/// communicator's asynchronous error.
int ws_nccl_comm_ready(ws_nccl_comm *comm, int *ready);

/// Returns the communicator's rank, world size and device.
int ws_nccl_comm_rank(const ws_nccl_comm *comm);
int ws_nccl_comm_world(const ws_nccl_comm *comm);
int ws_nccl_comm_device(const ws_nccl_comm *comm);

/// Queues one chunk's fill as one group on `stream` (one group per 2048
/// broadcasts, NCCL's limit): checks every broadcast (root in range; the
/// target range inside `target`; on the root, the source range inside its
/// region) first, so that nothing is queued when one is wrong, then
/// broadcasts each into `target` on every rank. A nonblocking communicator
/// may still be enqueuing when this returns: ws_nccl_comm_ready says when it
/// is done, before an event is recorded after the fill.
int ws_nccl_fill(ws_nccl_comm *comm, ws_cuda_stream *stream,
                 const ws_cuda_region *target, const ws_cuda_region *sources,
                 size_t source_count, const ws_nccl_broadcast *ops,
                 size_t count);

/// Queues one all-gather of equal blocks on `stream`: `bytes` at
/// `source_offset` of every rank land at `target_offset + rank * bytes` of
/// every rank's target (the benchmark's floor for the fill).
int ws_nccl_all_gather(ws_nccl_comm *comm, ws_cuda_stream *stream,
                       const ws_cuda_region *target, uint64_t target_offset,
                       const ws_cuda_region *source, uint64_t source_offset,
                       uint64_t bytes);

/// Destroys the communicator after its queued work (ncclCommDestroy; a
/// nonblocking one is finalized first, for at most 30 s, and aborted when it
/// cannot be) and frees the object; NULL is accepted.
int ws_nccl_comm_destroy(ws_nccl_comm *comm);

/// Aborts the communicator without waiting (ncclCommAbort: the poison path,
/// a peer may be dead) and frees the object; NULL is accepted.
int ws_nccl_comm_abort(ws_nccl_comm *comm);
