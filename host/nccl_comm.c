#include "nccl_comm.h"

#include "cuda_internal.h"
#include "library.h"
#include "status.h"

#include <stdlib.h>
#include <string.h>

// A communicator is NCCL's pointer (an opaque ncclComm_t) and where it
// stands; the accessors need no CUDA, so both builds share them.
typedef void *nccl_handle;

struct ws_nccl_comm {
  nccl_handle comm;
  int device;
  int world;
  int rank;
  int nonblocking;
};

int ws_nccl_comm_rank(const ws_nccl_comm *comm) { return comm->rank; }

int ws_nccl_comm_world(const ws_nccl_comm *comm) { return comm->world; }

int ws_nccl_comm_device(const ws_nccl_comm *comm) { return comm->device; }

#ifdef WSYNC_WITH_CUDA
#include <cuda_runtime_api.h>
#include <stdarg.h>
#include <stdio.h>
#include <time.h>

#if __has_include(<nccl.h>)
#include <nccl.h> // for ncclConfig_t only: every call goes through dlsym
#define WS_HAVE_NCCL_CONFIG 1
#endif

// NCCL's ABI as wsync uses it (stable across NCCL 2.x): results and data
// types are int-sized enums, a communicator is a pointer, a unique id is 128
// bytes passed by value.
typedef struct nccl_id {
  char internal[WS_NCCL_UNIQUE_ID_BYTES];
} nccl_id;

enum {
  NCCL_SUCCESS = 0,
  NCCL_IN_PROGRESS = 7,
  NCCL_UINT8 = 1,
  GROUP_MAX = 2048, // operations between ncclGroupStart and ncclGroupEnd
};

static const char *const result_names[] = {
    "ncclSuccess",         "ncclUnhandledCudaError", "ncclSystemError",
    "ncclInternalError",   "ncclInvalidArgument",    "ncclInvalidUsage",
    "ncclRemoteError",     "ncclInProgress",
};

struct nccl_library {
  int (*get_version)(int *version);
  int (*get_unique_id)(nccl_id *id);
  int (*comm_init_rank)(nccl_handle *comm, int world, nccl_id id, int rank);
  int (*comm_init_rank_config)(nccl_handle *comm, int world, nccl_id id,
                               int rank, void *config); // optional
  int (*comm_finalize)(nccl_handle comm); // optional
  int (*comm_destroy)(nccl_handle comm);
  int (*comm_abort)(nccl_handle comm);
  int (*comm_get_async_error)(nccl_handle comm, int *result);
  int (*group_start)(void);
  int (*group_end)(void);
  int (*broadcast)(const void *send, void *receive, size_t count, int type,
                   int root, nccl_handle comm, cudaStream_t stream);
  int (*all_gather)(const void *send, void *receive, size_t count, int type,
                    nccl_handle comm, cudaStream_t stream);
  const char *(*get_error_string)(int result);
  const char *(*get_last_error)(nccl_handle comm); // optional
  int version;
};

static struct nccl_library nccl;

static ws_library_symbol nccl_symbols[] = {
    {"ncclGetVersion", (void **)&nccl.get_version, 1},
    {"ncclGetUniqueId", (void **)&nccl.get_unique_id, 1},
    {"ncclCommInitRank", (void **)&nccl.comm_init_rank, 1},
    {"ncclCommInitRankConfig", (void **)&nccl.comm_init_rank_config, 0},
    {"ncclCommFinalize", (void **)&nccl.comm_finalize, 0},
    {"ncclCommDestroy", (void **)&nccl.comm_destroy, 1},
    {"ncclCommAbort", (void **)&nccl.comm_abort, 1},
    {"ncclCommGetAsyncError", (void **)&nccl.comm_get_async_error, 1},
    {"ncclGroupStart", (void **)&nccl.group_start, 1},
    {"ncclGroupEnd", (void **)&nccl.group_end, 1},
    {"ncclBroadcast", (void **)&nccl.broadcast, 1},
    {"ncclAllGather", (void **)&nccl.all_gather, 1},
    {"ncclGetErrorString", (void **)&nccl.get_error_string, 1},
    {"ncclGetLastError", (void **)&nccl.get_last_error, 0},
};

// NCCL's version, once its functions are found.
static int start_nccl(const char *path, char *detail, size_t size) {
  int result = nccl.get_version(&nccl.version);
  if (result != NCCL_SUCCESS) {
    snprintf(detail, size, "nccl: ncclGetVersion of %s failed (%d)", path,
             result);
    return WS_ENCCL;
  }
  return WS_OK;
}

static ws_library library = {
    .prefix = "nccl",
    .variable = "WSYNC_NCCL_LIBRARY",
    .default_path = "libnccl.so.2",
    .purpose = "NCCL is needed for trainer ranks on the cuda backend",
    .needs = "wsync needs NCCL 2.x",
    .symbols = nccl_symbols,
    .count = sizeof nccl_symbols / sizeof nccl_symbols[0],
    .start = start_nccl,
    .lock = PTHREAD_MUTEX_INITIALIZER,
};

static const char *result_name(int result) {
  if (result >= 0 &&
      (size_t)result < sizeof result_names / sizeof result_names[0])
    return result_names[result];
  return "ncclResultUnknown";
}

// Records an NCCL failure: "nccl: CONTEXT: CALL: ncclName (text): last error".
static int nccl_failure(int result, const char *call, const char *format, ...)
    __attribute__((format(printf, 3, 4)));

static int nccl_failure(int result, const char *call, const char *format,
                        ...) {
  char context[256];
  va_list args;
  va_start(args, format);
  vsnprintf(context, sizeof context, format, args);
  va_end(args);
  const char *text = nccl.get_error_string(result);
  const char *last = nccl.get_last_error ? nccl.get_last_error(NULL) : NULL;
  int has_last = last != NULL && last[0] != '\0';
  return ws_fail(WS_ENCCL, "nccl: %s: %s: %s (%s)%s%s", context, call,
                 result_name(result), text != NULL ? text : "?",
                 has_last ? ": " : "", has_last ? last : "");
}

int ws_nccl_built(void) { return 1; }

int ws_nccl_load(void) {
  ws_clear_error();
  return ws_library_load(&library);
}

int ws_nccl_version(int *version) {
  int status = ws_nccl_load();
  if (status != WS_OK)
    return status;
  *version = nccl.version;
  return WS_OK;
}

int ws_nccl_unique_id(unsigned char *id_out) {
  int status = ws_nccl_load();
  if (status != WS_OK)
    return status;
  nccl_id id;
  int result = nccl.get_unique_id(&id);
  if (result != NCCL_SUCCESS)
    return nccl_failure(result, "ncclGetUniqueId", "new communicator id");
  memcpy(id_out, id.internal, sizeof id.internal);
  return WS_OK;
}

// Joins without blocking (ncclCommInitRankConfig with blocking = 0).
static int init_nonblocking(nccl_handle *comm, int world, nccl_id id,
                            int rank) {
#ifdef WS_HAVE_NCCL_CONFIG
  if (nccl.comm_init_rank_config == NULL || nccl.version < 21400)
    return -1;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  // Claim no newer a config than the library knows: it reads the fields of
  // the version the config says.
  if ((int)config.version > nccl.version)
    config.version = (unsigned)nccl.version;
  config.blocking = 0;
  return nccl.comm_init_rank_config(comm, world, id, rank, &config);
#else
  (void)comm, (void)world, (void)id, (void)rank;
  return -1;
#endif
}

int ws_nccl_comm_init(int device, int world, int rank,
                      const unsigned char *id, int nonblocking,
                      ws_nccl_comm **out) {
  ws_clear_error();
  if (world < 1 || rank < 0 || rank >= world)
    return ws_fail(WS_EINVAL, "nccl: rank %d of a world of %d", rank, world);
  int status = ws_nccl_load();
  if (status != WS_OK)
    return status;
  ws_nccl_comm *comm = calloc(1, sizeof *comm);
  if (comm == NULL)
    return ws_fail(WS_ENOMEM, "nccl: cannot allocate a communicator object");
  int previous = 0;
  status = ws_cuda_enter(device, &previous);
  if (status != WS_OK) {
    free(comm);
    return status;
  }
  nccl_id unique;
  memcpy(unique.internal, id, sizeof unique.internal);
  const char *call = nonblocking ? "ncclCommInitRankConfig" : "ncclCommInitRank";
  int result = nonblocking
                   ? init_nonblocking(&comm->comm, world, unique, rank)
                   : nccl.comm_init_rank(&comm->comm, world, unique, rank);
  ws_cuda_leave(previous);
  if (result == -1) {
    status = ws_fail(WS_ENODEV, "nccl: NCCL %d cannot join without blocking "
                                "(needs 2.14 and ncclCommInitRankConfig)",
                     nccl.version);
  } else if (result != NCCL_SUCCESS &&
             !(nonblocking && result == NCCL_IN_PROGRESS)) {
    status = nccl_failure(result, call, "rank %d of %d on device %d", rank,
                          world, device);
    if (comm->comm != NULL)
      nccl.comm_abort(comm->comm);
  }
  if (status != WS_OK) {
    free(comm);
    return status;
  }
  comm->device = device;
  comm->world = world;
  comm->rank = rank;
  comm->nonblocking = nonblocking != 0;
  *out = comm;
  return WS_OK;
}

int ws_nccl_comm_ready(ws_nccl_comm *comm, int *ready) {
  ws_clear_error();
  int state = NCCL_SUCCESS;
  int result = nccl.comm_get_async_error(comm->comm, &state);
  if (result != NCCL_SUCCESS)
    return nccl_failure(result, "ncclCommGetAsyncError", "rank %d of %d",
                        comm->rank, comm->world);
  if (state != NCCL_SUCCESS && state != NCCL_IN_PROGRESS)
    return nccl_failure(state, "ncclCommGetAsyncError",
                        "rank %d of %d (asynchronous error)", comm->rank,
                        comm->world);
  *ready = state == NCCL_SUCCESS;
  return WS_OK;
}

static int range_fits(uint64_t offset, uint64_t length, uint64_t size) {
  return offset <= size && length <= size - offset;
}

static int check_broadcasts(const ws_nccl_comm *comm,
                            const ws_cuda_region *target,
                            const ws_cuda_region *sources, size_t source_count,
                            const ws_nccl_broadcast *ops, size_t count) {
  if (target->device != comm->device)
    return ws_fail(WS_EINVAL, "nccl fill: the target is on device %d, the "
                              "communicator on device %d",
                   (int)target->device, comm->device);
  for (size_t i = 0; i < count; i++) {
    const ws_nccl_broadcast *op = &ops[i];
    if (op->root < 0 || op->root >= comm->world)
      return ws_fail(WS_EINVAL, "nccl fill op %zu: root %d of a world of %d",
                     i, (int)op->root, comm->world);
    if (op->bytes == 0)
      continue;
    if (!range_fits(op->target_offset, op->bytes, target->size))
      return ws_fail(WS_EINVAL,
                     "nccl fill op %zu: target [%llu, +%llu) exceeds the "
                     "%llu-byte buffer",
                     i, (unsigned long long)op->target_offset,
                     (unsigned long long)op->bytes,
                     (unsigned long long)target->size);
    if (op->root != comm->rank)
      continue;
    if (op->source_region >= source_count)
      return ws_fail(WS_EINVAL, "nccl fill op %zu: source region %u of %zu",
                     i, op->source_region, source_count);
    const ws_cuda_region *source = &sources[op->source_region];
    if (!range_fits(op->source_offset, op->bytes, source->size))
      return ws_fail(WS_EINVAL,
                     "nccl fill op %zu: source [%llu, +%llu) exceeds region "
                     "%u (%llu bytes)",
                     i, (unsigned long long)op->source_offset,
                     (unsigned long long)op->bytes, op->source_region,
                     (unsigned long long)source->size);
  }
  return WS_OK;
}

// Waits (every millisecond, for at most WAIT_SECONDS: a dead peer must not
// hang the host) until a nonblocking communicator's last operation is done.
enum { WAIT_SECONDS = 30 };

static int wait_state(ws_nccl_comm *comm, const char *what) {
  for (int waited = 0; waited < WAIT_SECONDS * 1000; waited++) {
    int state = NCCL_SUCCESS;
    int result = nccl.comm_get_async_error(comm->comm, &state);
    if (result != NCCL_SUCCESS)
      return nccl_failure(result, "ncclCommGetAsyncError", "%s, rank %d of %d",
                          what, comm->rank, comm->world);
    if (state == NCCL_SUCCESS)
      return WS_OK;
    if (state != NCCL_IN_PROGRESS)
      return nccl_failure(state, "ncclCommGetAsyncError",
                          "%s, rank %d of %d", what, comm->rank, comm->world);
    struct timespec pause = {0, 1000 * 1000};
    nanosleep(&pause, NULL);
  }
  return ws_fail(WS_ESTATE, "nccl: %s of rank %d of %d not done within %d s",
                 what, comm->rank, comm->world, WAIT_SECONDS);
}

// A nonblocking communicator finalizes before it is destroyed.
static int finalize(ws_nccl_comm *comm) {
  if (nccl.comm_finalize == NULL)
    return WS_OK;
  int result = nccl.comm_finalize(comm->comm);
  if (result != NCCL_SUCCESS && result != NCCL_IN_PROGRESS)
    return nccl_failure(result, "ncclCommFinalize", "rank %d of %d",
                        comm->rank, comm->world);
  return wait_state(comm, "finalize");
}

// Ends a group begun with ncclGroupStart; `result` is the first failure
// inside it, if any.
static int end_group(const ws_nccl_comm *comm, int result, const char *call,
                     size_t op, const char *what) {
  int ended = nccl.group_end();
  if (result != NCCL_SUCCESS)
    return nccl_failure(result, call, "%s op %zu, rank %d of %d", what, op,
                        comm->rank, comm->world);
  if (ended != NCCL_SUCCESS &&
      !(comm->nonblocking && ended == NCCL_IN_PROGRESS))
    return nccl_failure(ended, "ncclGroupEnd", "%s, rank %d of %d", what,
                        comm->rank, comm->world);
  return WS_OK;
}

int ws_nccl_fill(ws_nccl_comm *comm, ws_cuda_stream *stream,
                 const ws_cuda_region *target, const ws_cuda_region *sources,
                 size_t source_count, const ws_nccl_broadcast *ops,
                 size_t count) {
  ws_clear_error();
  int status =
      check_broadcasts(comm, target, sources, source_count, ops, count);
  if (status != WS_OK)
    return status;
  void *raw = NULL;
  int previous = 0;
  status = ws_cuda_enter_stream(stream, comm->device, &raw, &previous);
  if (status != WS_OK)
    return status;
  status = ws_cuda_check_region(target, comm->device, "fill target", 0);
  for (size_t i = 0; i < count && status == WS_OK; i++)
    if (ops[i].bytes > 0 && ops[i].root == comm->rank)
      status = ws_cuda_check_region(&sources[ops[i].source_region],
                                    comm->device, "fill source",
                                    ops[i].source_region);
  if (status != WS_OK || count == 0) {
    ws_cuda_leave(previous);
    return status;
  }
  // Groups of at most GROUP_MAX broadcasts (NCCL documents 2048 operations a
  // group), cut at the same places on every rank: the list and the skipped
  // (empty) broadcasts are the same everywhere.
  status = WS_OK;
  size_t next = 0;
  while (status == WS_OK && next < count) {
    // A nonblocking communicator takes its next call once the last is done.
    if (next > 0 && comm->nonblocking &&
        (status = wait_state(comm, "fill group")) != WS_OK)
      break;
    int result = nccl.group_start();
    if (result != NCCL_SUCCESS) {
      status = nccl_failure(result, "ncclGroupStart", "fill, rank %d of %d",
                            comm->rank, comm->world);
      break;
    }
    size_t grouped = 0, failed = next;
    for (; next < count && grouped < GROUP_MAX && result == NCCL_SUCCESS;
         next++) {
      const ws_nccl_broadcast *op = &ops[next];
      if (op->bytes == 0)
        continue;
      void *receive = (char *)(uintptr_t)target->pointer + op->target_offset;
      const void *send = receive;
      if (op->root == comm->rank)
        send = (const char *)(uintptr_t)sources[op->source_region].pointer +
               op->source_offset;
      result = nccl.broadcast(send, receive, op->bytes, NCCL_UINT8, op->root,
                              comm->comm, (cudaStream_t)raw);
      failed = next;
      grouped++;
    }
    status = end_group(comm, result, "ncclBroadcast", failed, "fill");
  }
  ws_cuda_leave(previous);
  return status;
}

int ws_nccl_all_gather(ws_nccl_comm *comm, ws_cuda_stream *stream,
                       const ws_cuda_region *target, uint64_t target_offset,
                       const ws_cuda_region *source, uint64_t source_offset,
                       uint64_t bytes) {
  ws_clear_error();
  if (bytes > UINT64_MAX / (uint64_t)comm->world ||
      !range_fits(target_offset, bytes * (uint64_t)comm->world, target->size))
    return ws_fail(WS_EINVAL,
                   "nccl all-gather: %d blocks of %llu bytes at %llu exceed "
                   "the %llu-byte target",
                   comm->world, (unsigned long long)bytes,
                   (unsigned long long)target_offset,
                   (unsigned long long)target->size);
  if (!range_fits(source_offset, bytes, source->size))
    return ws_fail(WS_EINVAL,
                   "nccl all-gather: source [%llu, +%llu) exceeds the "
                   "%llu-byte region",
                   (unsigned long long)source_offset,
                   (unsigned long long)bytes,
                   (unsigned long long)source->size);
  void *raw = NULL;
  int previous = 0;
  int status = ws_cuda_enter_stream(stream, comm->device, &raw, &previous);
  if (status != WS_OK)
    return status;
  status = ws_cuda_check_region(target, comm->device, "all-gather target", 0);
  if (status == WS_OK)
    status =
        ws_cuda_check_region(source, comm->device, "all-gather source", 0);
  if (status == WS_OK) {
    int result = nccl.all_gather(
        (const char *)(uintptr_t)source->pointer + source_offset,
        (char *)(uintptr_t)target->pointer + target_offset, bytes, NCCL_UINT8,
        comm->comm, (cudaStream_t)raw);
    if (result != NCCL_SUCCESS &&
        !(comm->nonblocking && result == NCCL_IN_PROGRESS))
      status = nccl_failure(result, "ncclAllGather",
                            "%llu bytes a rank, rank %d of %d",
                            (unsigned long long)bytes, comm->rank,
                            comm->world);
  }
  ws_cuda_leave(previous);
  return status;
}

static int end_comm(ws_nccl_comm *comm, int abort) {
  ws_clear_error();
  if (comm == NULL)
    return WS_OK;
  int previous = 0;
  int entered = ws_cuda_enter(comm->device, &previous);
  int status = WS_OK;
  if (!abort && comm->nonblocking) {
    status = finalize(comm);
    abort = status != WS_OK; // what could not finalize is aborted
  }
  int result = abort ? nccl.comm_abort(comm->comm)
                     : nccl.comm_destroy(comm->comm);
  if (entered == WS_OK)
    ws_cuda_leave(previous);
  if (status == WS_OK && result != NCCL_SUCCESS && result != NCCL_IN_PROGRESS)
    status = nccl_failure(result, abort ? "ncclCommAbort" : "ncclCommDestroy",
                          "rank %d of %d", comm->rank, comm->world);
  free(comm);
  return status;
}

int ws_nccl_comm_destroy(ws_nccl_comm *comm) { return end_comm(comm, 0); }

int ws_nccl_comm_abort(ws_nccl_comm *comm) { return end_comm(comm, 1); }

#else // !WSYNC_WITH_CUDA

static int not_built(void) {
  return ws_fail(WS_ENODEV, "nccl: this wsync was built without CUDA");
}

int ws_nccl_built(void) { return 0; }

int ws_nccl_load(void) {
  ws_clear_error();
  return not_built();
}

int ws_nccl_version(int *version) {
  ws_clear_error();
  (void)version;
  return not_built();
}

int ws_nccl_unique_id(unsigned char *id_out) {
  ws_clear_error();
  (void)id_out;
  return not_built();
}

int ws_nccl_comm_init(int device, int world, int rank,
                      const unsigned char *id, int nonblocking,
                      ws_nccl_comm **out) {
  ws_clear_error();
  (void)device, (void)world, (void)rank, (void)id, (void)nonblocking;
  (void)out;
  return not_built();
}

int ws_nccl_comm_ready(ws_nccl_comm *comm, int *ready) {
  ws_clear_error();
  (void)comm, (void)ready;
  return not_built();
}

int ws_nccl_fill(ws_nccl_comm *comm, ws_cuda_stream *stream,
                 const ws_cuda_region *target, const ws_cuda_region *sources,
                 size_t source_count, const ws_nccl_broadcast *ops,
                 size_t count) {
  ws_clear_error();
  (void)comm, (void)stream, (void)target, (void)sources, (void)source_count;
  (void)ops, (void)count;
  return not_built();
}

int ws_nccl_all_gather(ws_nccl_comm *comm, ws_cuda_stream *stream,
                       const ws_cuda_region *target, uint64_t target_offset,
                       const ws_cuda_region *source, uint64_t source_offset,
                       uint64_t bytes) {
  ws_clear_error();
  (void)comm, (void)stream, (void)target, (void)target_offset, (void)source;
  (void)source_offset, (void)bytes;
  return not_built();
}

int ws_nccl_comm_destroy(ws_nccl_comm *comm) {
  ws_clear_error();
  return comm == NULL ? WS_OK : not_built();
}

int ws_nccl_comm_abort(ws_nccl_comm *comm) {
  ws_clear_error();
  return comm == NULL ? WS_OK : not_built();
}

#endif
