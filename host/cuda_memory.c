#include "cuda_memory.h"

#include "cuda_internal.h"
#include "status.h"

#include <stdlib.h>
#include <string.h>

static int check_range(const ws_cuda_region *region, uint64_t offset,
                       uint64_t length, const char *what);

// The small transfers between the host and a region (ws_cuda_write,
// ws_cuda_read, ws_cuda_memset), by the name their messages give them.
typedef enum transfer_kind {
  TRANSFER_WRITE,
  TRANSFER_READ,
  TRANSFER_MEMSET,
} transfer_kind;

static const char *const transfer_names[] = {"write", "read", "memset"};

// Does one small transfer of `length` bytes at `offset` in `region` on
// `stream`: a write from `from_host`, a read into `to_host` (both waited
// for) or a fill with `value` (queued).
static int transfer(const ws_cuda_region *region, uint64_t offset,
                    uint64_t length, ws_cuda_stream *stream,
                    transfer_kind kind, const void *from_host, void *to_host,
                    int value);

// Queues one stream memory operation (`write`: cuStreamWriteValue32, else
// cuStreamWaitValue32) on the word at `offset` of `region`.
static int stream_value(ws_cuda_stream *stream, const ws_cuda_region *region,
                        uint64_t offset, uint32_t value, int write);

#ifdef WSYNC_WITH_CUDA
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>

// ---------------------------------------------------------------------------
// Errors, counters, the device switch

static ws_cuda_counters counters;

static void count(uint64_t *field, uint64_t amount) {
  __atomic_fetch_add(field, amount, __ATOMIC_RELAXED);
}

static void uncount(uint64_t *field, uint64_t amount) {
  __atomic_fetch_sub(field, amount, __ATOMIC_RELAXED);
}

static int status_of(cudaError_t error) {
  switch (error) {
  case cudaErrorNoDevice:
  case cudaErrorInsufficientDriver:
  case cudaErrorSystemDriverMismatch:
  case cudaErrorCompatNotSupportedOnDevice:
  case cudaErrorDevicesUnavailable:
    return WS_ENODEV;
  case cudaErrorMemoryAllocation:
    return WS_ENOMEM;
  default:
    return WS_ECUDA;
  }
}

int ws_cuda_failure(int error, const char *call, const char *format, ...) {
  char context[256];
  va_list args;
  va_start(args, format);
  vsnprintf(context, sizeof context, format, args);
  va_end(args);
  cudaError_t code = (cudaError_t)error;
  return ws_fail(status_of(code), "cuda: %s: %s: %s (%s)", context, call,
                 cudaGetErrorName(code), cudaGetErrorString(code));
}

int ws_cuda_enter(int device, int *previous) {
  int count_visible = 0;
  cudaError_t error = cudaGetDeviceCount(&count_visible);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, "cudaGetDeviceCount", "device %d", device);
  if (count_visible == 0)
    return ws_fail(WS_ENODEV, "cuda: device %d: no CUDA device is visible",
                   device);
  if (device < 0 || device >= count_visible)
    return ws_fail(WS_EINVAL, "cuda: device %d out of range (%d visible)",
                   device, count_visible);
  error = cudaGetDevice(previous);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, "cudaGetDevice", "device %d", device);
  if (*previous != device) {
    error = cudaSetDevice(device);
    if (error != cudaSuccess)
      return ws_cuda_failure(error, "cudaSetDevice", "device %d", device);
  }
  return WS_OK;
}

void ws_cuda_leave(int previous) {
  int current = previous;
  if (cudaGetDevice(&current) == cudaSuccess && current != previous)
    cudaSetDevice(previous);
}

int ws_cuda_allocate(size_t size, void **out, const char *what) {
  void *pointer = NULL;
  cudaError_t error = cudaMalloc(&pointer, size);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, "cudaMalloc", "%s of %zu bytes", what, size);
  count(&counters.allocations, 1);
  count(&counters.live_bytes, size);
  *out = pointer;
  return WS_OK;
}

int ws_cuda_release(void *pointer, size_t size, const char *what) {
  if (pointer == NULL)
    return WS_OK;
  cudaError_t error = cudaFree(pointer);
  count(&counters.frees, 1);
  uncount(&counters.live_bytes, size);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, "cudaFree", "%s of %zu bytes", what, size);
  return WS_OK;
}

void ws_cuda_count_launch(void) { count(&counters.launches, 1); }

void ws_cuda_counters_get(ws_cuda_counters *out) {
  out->allocations = __atomic_load_n(&counters.allocations, __ATOMIC_RELAXED);
  out->frees = __atomic_load_n(&counters.frees, __ATOMIC_RELAXED);
  out->live_bytes = __atomic_load_n(&counters.live_bytes, __ATOMIC_RELAXED);
  out->exports = __atomic_load_n(&counters.exports, __ATOMIC_RELAXED);
  out->ipc_opens = __atomic_load_n(&counters.ipc_opens, __ATOMIC_RELAXED);
  out->ipc_closes = __atomic_load_n(&counters.ipc_closes, __ATOMIC_RELAXED);
  out->mappings_reused =
      __atomic_load_n(&counters.mappings_reused, __ATOMIC_RELAXED);
  out->live_mappings =
      __atomic_load_n(&counters.live_mappings, __ATOMIC_RELAXED);
  out->launches = __atomic_load_n(&counters.launches, __ATOMIC_RELAXED);
}

int ws_cuda_wait(void *raw_stream, void *raw_event, const char *what) {
  cudaStream_t stream = (cudaStream_t)raw_stream;
  cudaEvent_t event = (cudaEvent_t)raw_event;
  cudaEvent_t temporary = NULL;
  cudaError_t error = cudaSuccess;
  if (event == NULL) {
    error = cudaEventCreateWithFlags(&temporary, cudaEventBlockingSync |
                                                     cudaEventDisableTiming);
    if (error != cudaSuccess)
      return ws_cuda_failure(error, "cudaEventCreateWithFlags", "%s", what);
    event = temporary;
  }
  const char *call = "cudaEventRecord";
  error = cudaEventRecord(event, stream);
  if (error == cudaSuccess) {
    call = "cudaEventSynchronize";
    error = cudaEventSynchronize(event);
  }
  if (temporary != NULL)
    cudaEventDestroy(temporary);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, call, "%s", what);
  return WS_OK;
}

// ---------------------------------------------------------------------------
// Regions

// cuMemGetAddressRange from the driver, found through the runtime (no link
// against libcuda): the real size of the allocation behind a pointer, so that
// a region or an imported size that claims more is refused.
typedef int (*address_range_fn)(unsigned long long *base, size_t *size,
                                unsigned long long pointer);

// cuStreamWaitValue32 / cuStreamWriteValue32 (CUstream, CUdeviceptr,
// cuuint32_t, flags 0: wait for a cyclic greater-or-equal; write after a
// memory barrier) and cuGetErrorName, found the same way.
typedef int (*stream_value_fn)(void *stream, unsigned long long address,
                               unsigned int value, unsigned int flags);
typedef int (*error_name_fn)(int result, const char **name);

static pthread_once_t driver_once = PTHREAD_ONCE_INIT;
static address_range_fn address_range;
static stream_value_fn wait_value, write_value;
static error_name_fn error_name;

static void *driver_function(const char *symbol) {
  void *function = NULL;
  enum cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(symbol, &function, 12000,
                                       cudaEnableDefault,
                                       &found) == cudaSuccess &&
      found == cudaDriverEntryPointSuccess)
    return function;
  return NULL;
}

static void find_driver_functions(void) {
  address_range = (address_range_fn)driver_function("cuMemGetAddressRange");
  wait_value = (stream_value_fn)driver_function("cuStreamWaitValue32");
  write_value = (stream_value_fn)driver_function("cuStreamWriteValue32");
  error_name = (error_name_fn)driver_function("cuGetErrorName");
}

// Stores the base and size of the allocation holding `pointer`; `*size` 0
// when the driver does not say (no entry point, or memory it does not
// describe this way): the checks that use it are then skipped, never failed.
static void allocation_of(uint64_t pointer, uint64_t *base, uint64_t *size) {
  pthread_once(&driver_once, find_driver_functions);
  *base = pointer;
  *size = 0;
  if (address_range == NULL)
    return;
  unsigned long long found_base = 0;
  size_t found_size = 0;
  if (address_range(&found_base, &found_size, pointer) != 0)
    return;
  *base = found_base;
  *size = found_size;
}

int ws_cuda_check_region(const ws_cuda_region *region, int device,
                         const char *role, size_t index) {
  if (region->pointer == 0)
    return ws_fail(WS_EINVAL, "cuda: %s %zu: null pointer", role, index);
  if (region->pointer > UINT64_MAX - region->size)
    return ws_fail(WS_EOVERFLOW, "cuda: %s %zu: 0x%llx + %llu bytes overflows",
                   role, index, (unsigned long long)region->pointer,
                   (unsigned long long)region->size);
  if (region->device != device)
    return ws_fail(WS_EINVAL, "cuda: %s %zu is on device %d, not device %d",
                   role, index, (int)region->device, device);
  struct cudaPointerAttributes attributes;
  cudaError_t error =
      cudaPointerGetAttributes(&attributes, (const void *)region->pointer);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, "cudaPointerGetAttributes", "%s %zu", role,
                           index);
  if (attributes.type != cudaMemoryTypeDevice &&
      attributes.type != cudaMemoryTypeManaged)
    return ws_fail(WS_EINVAL, "cuda: %s %zu at 0x%llx is not device memory",
                   role, index, (unsigned long long)region->pointer);
  if (attributes.device != device)
    return ws_fail(WS_EINVAL,
                   "cuda: %s %zu at 0x%llx is memory of device %d, not "
                   "device %d",
                   role, index, (unsigned long long)region->pointer,
                   attributes.device, device);
  uint64_t base = 0, size = 0;
  allocation_of(region->pointer, &base, &size);
  if (size != 0 && region->pointer + region->size > base + size)
    return ws_fail(WS_EINVAL,
                   "cuda: %s %zu [0x%llx, +%llu bytes) runs %llu bytes past "
                   "the end of its allocation",
                   role, index, (unsigned long long)region->pointer,
                   (unsigned long long)region->size,
                   (unsigned long long)(region->pointer + region->size -
                                        base - size));
  return WS_OK;
}

// ---------------------------------------------------------------------------
// Buffers

struct ws_cuda_buffer {
  void *pointer;
  size_t size;
  int device;
  int exported;
  unsigned char handle[WS_CUDA_IPC_HANDLE_BYTES];
};

// Allocates a zeroed object of `size` bytes (`what` names it in the message)
// and enters `device` (the previous one in `*previous`); NULL with the
// failure in `*status` when either fails, the object freed again.
static void *new_on_device(size_t size, const char *what, int device,
                           int *previous, int *status) {
  void *object = calloc(1, size);
  if (object == NULL) {
    *status = ws_fail(WS_ENOMEM, "cuda: cannot allocate %s", what);
    return NULL;
  }
  *status = ws_cuda_enter(device, previous);
  if (*status != WS_OK) {
    free(object);
    return NULL;
  }
  return object;
}

int ws_cuda_buffer_create(int device, size_t size, ws_cuda_buffer **out) {
  ws_clear_error();
  if (size == 0)
    return ws_fail(WS_EINVAL, "cuda: a buffer needs a positive size");
  int previous = 0, status = WS_OK;
  ws_cuda_buffer *buffer =
      new_on_device(sizeof *buffer, "a buffer object", device, &previous,
                    &status);
  if (buffer == NULL)
    return status;
  status = ws_cuda_allocate(size, &buffer->pointer, "buffer");
  if (status == WS_OK) {
    cudaError_t error = cudaMemsetAsync(buffer->pointer, 0, size, 0);
    if (error != cudaSuccess)
      status = ws_cuda_failure(error, "cudaMemsetAsync",
                               "zero-filling a %zu-byte buffer", size);
    else
      status = ws_cuda_wait(0, NULL, "zero-filling a buffer");
    if (status != WS_OK)
      ws_cuda_release(buffer->pointer, size, "buffer");
  }
  ws_cuda_leave(previous);
  if (status != WS_OK) {
    free(buffer);
    return status;
  }
  buffer->size = size;
  buffer->device = device;
  *out = buffer;
  return WS_OK;
}

int ws_cuda_buffer_export(ws_cuda_buffer *buffer, unsigned char *handle_out) {
  ws_clear_error();
  if (!buffer->exported) {
    int previous = 0;
    int status = ws_cuda_enter(buffer->device, &previous);
    if (status != WS_OK)
      return status;
    cudaIpcMemHandle_t handle;
    cudaError_t error = cudaIpcGetMemHandle(&handle, buffer->pointer);
    ws_cuda_leave(previous);
    if (error != cudaSuccess)
      return ws_cuda_failure(error, "cudaIpcGetMemHandle",
                             "export of a %zu-byte buffer on device %d",
                             buffer->size, buffer->device);
    count(&counters.exports, 1);
    _Static_assert(sizeof handle == WS_CUDA_IPC_HANDLE_BYTES,
                   "cudaIpcMemHandle_t is 64 bytes");
    memcpy(buffer->handle, &handle, sizeof handle);
    buffer->exported = 1;
  }
  memcpy(handle_out, buffer->handle, WS_CUDA_IPC_HANDLE_BYTES);
  return WS_OK;
}

int ws_cuda_export_region(const ws_cuda_region *region,
                          unsigned char *handle_out, uint64_t *allocation_size,
                          uint64_t *offset) {
  ws_clear_error();
  int status =
      ws_cuda_check_region(region, region->device, "exported memory", 1);
  if (status != WS_OK)
    return status;
  uint64_t base = 0, size = 0;
  allocation_of(region->pointer, &base, &size);
  if (size == 0)
    return ws_fail(WS_EINVAL,
                   "cuda: the driver does not say which allocation holds "
                   "0x%llx (cuMemGetAddressRange): it cannot be exported",
                   (unsigned long long)region->pointer);
  int previous = 0;
  status = ws_cuda_enter(region->device, &previous);
  if (status != WS_OK)
    return status;
  cudaIpcMemHandle_t handle;
  cudaError_t error = cudaIpcGetMemHandle(&handle, (void *)(uintptr_t)base);
  ws_cuda_leave(previous);
  if (error != cudaSuccess)
    return ws_cuda_failure(
        error, "cudaIpcGetMemHandle",
        "export of the %llu-byte allocation at 0x%llx on device %d that holds "
        "0x%llx (memory from cuMemCreate, such as torch's expandable "
        "segments, cannot be exported this way)",
        (unsigned long long)size, (unsigned long long)base, (int)region->device,
        (unsigned long long)region->pointer);
  count(&counters.exports, 1);
  memcpy(handle_out, &handle, sizeof handle);
  *allocation_size = size;
  *offset = region->pointer - base;
  return WS_OK;
}

void ws_cuda_buffer_region(const ws_cuda_buffer *buffer, ws_cuda_region *out) {
  out->pointer = (uint64_t)(uintptr_t)buffer->pointer;
  out->size = buffer->size;
  out->device = buffer->device;
  out->reserved = 0;
}

int ws_cuda_buffer_close(ws_cuda_buffer *buffer) {
  ws_clear_error();
  if (buffer == NULL)
    return WS_OK;
  int previous = 0;
  int status = ws_cuda_enter(buffer->device, &previous);
  if (status == WS_OK) {
    status = ws_cuda_release(buffer->pointer, buffer->size, "buffer");
    ws_cuda_leave(previous);
  }
  free(buffer);
  return status;
}

// ---------------------------------------------------------------------------
// IPC mappings: one cudaIpcOpenMemHandle per buffer per process

struct ipc_entry {
  struct ipc_entry *next;
  unsigned char handle[WS_CUDA_IPC_HANDLE_BYTES];
  int device;
  void *pointer;
  uint64_t allocation_size; // 0 when the driver does not say
  unsigned references;
};

struct ws_cuda_mapping {
  struct ipc_entry *entry;
  size_t size;
};

static pthread_mutex_t ipc_lock = PTHREAD_MUTEX_INITIALIZER;
static struct ipc_entry *ipc_entries;

static struct ipc_entry *find_entry(const unsigned char *handle, int device) {
  for (struct ipc_entry *entry = ipc_entries; entry != NULL;
       entry = entry->next)
    if (entry->device == device &&
        memcmp(entry->handle, handle, WS_CUDA_IPC_HANDLE_BYTES) == 0)
      return entry;
  return NULL;
}

// Opens the handle (ipc_lock held) and checks the claimed size against the
// allocation's.
static int open_entry(int device, const unsigned char *handle, size_t size,
                      struct ipc_entry **out) {
  int previous = 0, status = WS_OK;
  struct ipc_entry *entry =
      new_on_device(sizeof *entry, "a mapping entry", device, &previous,
                    &status);
  if (entry == NULL)
    return status;
  cudaIpcMemHandle_t ipc_handle;
  memcpy(&ipc_handle, handle, sizeof ipc_handle);
  cudaError_t error = cudaIpcOpenMemHandle(&entry->pointer, ipc_handle,
                                           cudaIpcMemLazyEnablePeerAccess);
  if (error != cudaSuccess) {
    status = ws_cuda_failure(error, "cudaIpcOpenMemHandle",
                             "import of a %zu-byte buffer on device %d", size,
                             device);
  } else {
    count(&counters.ipc_opens, 1);
    uint64_t base = 0;
    allocation_of((uint64_t)(uintptr_t)entry->pointer, &base,
                  &entry->allocation_size);
    if (entry->allocation_size != 0 &&
        size > entry->allocation_size)
      status = ws_fail(WS_EINVAL,
                       "cuda: import on device %d: the exported buffer holds "
                       "%llu bytes, not %zu",
                       device, (unsigned long long)entry->allocation_size,
                       size);
    if (status != WS_OK) {
      cudaIpcCloseMemHandle(entry->pointer);
      count(&counters.ipc_closes, 1);
    }
  }
  ws_cuda_leave(previous);
  if (status != WS_OK) {
    free(entry);
    return status;
  }
  memcpy(entry->handle, handle, WS_CUDA_IPC_HANDLE_BYTES);
  entry->device = device;
  entry->references = 1;
  entry->next = ipc_entries;
  ipc_entries = entry;
  count(&counters.live_mappings, 1);
  *out = entry;
  return WS_OK;
}

int ws_cuda_mapping_open(int device, const unsigned char *handle, size_t size,
                         ws_cuda_mapping **out) {
  ws_clear_error();
  if (size == 0)
    return ws_fail(WS_EINVAL, "cuda: an imported buffer needs a positive size");
  ws_cuda_mapping *mapping = calloc(1, sizeof *mapping);
  if (mapping == NULL)
    return ws_fail(WS_ENOMEM, "cuda: cannot allocate a mapping object");
  pthread_mutex_lock(&ipc_lock);
  int status = WS_OK;
  struct ipc_entry *entry = find_entry(handle, device);
  if (entry != NULL) {
    if (entry->allocation_size != 0 && size > entry->allocation_size)
      status = ws_fail(WS_EINVAL,
                       "cuda: import on device %d: the exported buffer holds "
                       "%llu bytes, not %zu",
                       device, (unsigned long long)entry->allocation_size,
                       size);
    else {
      entry->references++;
      count(&counters.mappings_reused, 1);
    }
  } else {
    status = open_entry(device, handle, size, &entry);
  }
  pthread_mutex_unlock(&ipc_lock);
  if (status != WS_OK) {
    free(mapping);
    return status;
  }
  mapping->entry = entry;
  mapping->size = size;
  *out = mapping;
  return WS_OK;
}

void ws_cuda_mapping_region(const ws_cuda_mapping *mapping,
                            ws_cuda_region *out) {
  out->pointer = (uint64_t)(uintptr_t)mapping->entry->pointer;
  out->size = mapping->size;
  out->device = mapping->entry->device;
  out->reserved = 0;
}

int ws_cuda_mapping_close(ws_cuda_mapping *mapping) {
  ws_clear_error();
  if (mapping == NULL)
    return WS_OK;
  int status = WS_OK;
  struct ipc_entry *entry = mapping->entry;
  free(mapping);
  pthread_mutex_lock(&ipc_lock);
  if (--entry->references == 0) {
    for (struct ipc_entry **link = &ipc_entries; *link != NULL;
         link = &(*link)->next)
      if (*link == entry) {
        *link = entry->next;
        break;
      }
    int previous = 0;
    status = ws_cuda_enter(entry->device, &previous);
    if (status == WS_OK) {
      cudaError_t error = cudaIpcCloseMemHandle(entry->pointer);
      ws_cuda_leave(previous);
      if (error != cudaSuccess)
        status = ws_cuda_failure(error, "cudaIpcCloseMemHandle",
                                 "closing an imported buffer on device %d",
                                 entry->device);
    }
    count(&counters.ipc_closes, 1);
    uncount(&counters.live_mappings, 1);
    free(entry);
  }
  pthread_mutex_unlock(&ipc_lock);
  return status;
}

// ---------------------------------------------------------------------------
// Streams and events

struct ws_cuda_stream {
  cudaStream_t stream;
  cudaEvent_t done; // for synchronize: waits in the driver
  int device;
};

struct ws_cuda_event {
  cudaEvent_t event;
  int device;
};

int ws_cuda_stream_create(int device, ws_cuda_stream **out) {
  ws_clear_error();
  int previous = 0, status = WS_OK;
  ws_cuda_stream *stream =
      new_on_device(sizeof *stream, "a stream object", device, &previous,
                    &status);
  if (stream == NULL)
    return status;
  cudaError_t error =
      cudaStreamCreateWithFlags(&stream->stream, cudaStreamNonBlocking);
  if (error != cudaSuccess) {
    status = ws_cuda_failure(error, "cudaStreamCreateWithFlags",
                             "stream on device %d", device);
  } else {
    error = cudaEventCreateWithFlags(
        &stream->done, cudaEventBlockingSync | cudaEventDisableTiming);
    if (error != cudaSuccess) {
      status = ws_cuda_failure(error, "cudaEventCreateWithFlags",
                               "stream on device %d", device);
      cudaStreamDestroy(stream->stream);
    }
  }
  ws_cuda_leave(previous);
  if (status != WS_OK) {
    free(stream);
    return status;
  }
  stream->device = device;
  *out = stream;
  return WS_OK;
}

int ws_cuda_stream_device(const ws_cuda_stream *stream) {
  return stream->device;
}

void *ws_cuda_stream_handle(const ws_cuda_stream *stream) {
  return (void *)stream->stream;
}

int ws_cuda_stream_for(ws_cuda_stream *stream, int device, void **raw) {
  if (stream == NULL) {
    *raw = NULL;
    return WS_OK;
  }
  if (stream->device != device)
    return ws_fail(WS_EINVAL, "cuda: a stream of device %d for work on device %d",
                   stream->device, device);
  *raw = (void *)stream->stream;
  return WS_OK;
}

int ws_cuda_enter_stream(ws_cuda_stream *stream, int device, void **raw,
                         int *previous) {
  int status = ws_cuda_stream_for(stream, device, raw);
  if (status != WS_OK)
    return status;
  return ws_cuda_enter(device, previous);
}

int ws_cuda_stream_synchronize(ws_cuda_stream *stream) {
  ws_clear_error();
  int previous = 0;
  int status = ws_cuda_enter(stream->device, &previous);
  if (status != WS_OK)
    return status;
  status = ws_cuda_wait(stream->stream, stream->done, "stream synchronize");
  ws_cuda_leave(previous);
  return status;
}

int ws_cuda_stream_destroy(ws_cuda_stream *stream) {
  ws_clear_error();
  if (stream == NULL)
    return WS_OK;
  int previous = 0;
  int status = ws_cuda_enter(stream->device, &previous);
  if (status == WS_OK) {
    cudaEventDestroy(stream->done);
    cudaError_t error = cudaStreamDestroy(stream->stream);
    ws_cuda_leave(previous);
    if (error != cudaSuccess)
      status = ws_cuda_failure(error, "cudaStreamDestroy", "stream on device %d",
                               stream->device);
  }
  free(stream);
  return status;
}

static int stream_value(ws_cuda_stream *stream, const ws_cuda_region *region,
                        uint64_t offset, uint32_t value, int write) {
  ws_clear_error();
  const char *call = write ? "cuStreamWriteValue32" : "cuStreamWaitValue32";
  if (region->device != stream->device)
    return ws_fail(WS_EINVAL, "cuda: %s: a word on device %d and a stream of "
                              "device %d", call, (int)region->device,
                   stream->device);
  if (offset % 4 != 0 || offset > region->size || region->size - offset < 4)
    return ws_fail(WS_EINVAL, "cuda: %s: word at %llu of a region of %llu "
                              "bytes (4-byte aligned, inside it)", call,
                   (unsigned long long)offset,
                   (unsigned long long)region->size);
  pthread_once(&driver_once, find_driver_functions);
  stream_value_fn function = write ? write_value : wait_value;
  if (function == NULL)
    return ws_fail(WS_ENODEV, "cuda: this driver has no %s (stream memory "
                               "operations)", call);
  int previous = 0;
  int status = ws_cuda_enter(stream->device, &previous);
  if (status != WS_OK)
    return status;
  int result =
      function((void *)stream->stream, region->pointer + offset, value, 0);
  ws_cuda_leave(previous);
  if (result != 0) {
    const char *name = NULL;
    if (error_name == NULL || error_name(result, &name) != 0 || name == NULL)
      name = "CUDA_ERROR_UNKNOWN";
    return ws_fail(result == 801 ? WS_ENODEV : WS_ECUDA,
                   "cuda: %s of %u at word %llu on device %d: %s (%d)", call,
                   value, (unsigned long long)offset, stream->device, name,
                   result);
  }
  return WS_OK;
}

int ws_cuda_event_create(int device, int timing, ws_cuda_event **out) {
  ws_clear_error();
  int previous = 0, status = WS_OK;
  ws_cuda_event *event =
      new_on_device(sizeof *event, "an event object", device, &previous,
                    &status);
  if (event == NULL)
    return status;
  unsigned flags = cudaEventBlockingSync | (timing ? 0 : cudaEventDisableTiming);
  cudaError_t error = cudaEventCreateWithFlags(&event->event, flags);
  ws_cuda_leave(previous);
  if (error != cudaSuccess) {
    free(event);
    return ws_cuda_failure(error, "cudaEventCreateWithFlags",
                           "event on device %d", device);
  }
  event->device = device;
  *out = event;
  return WS_OK;
}

int ws_cuda_event_record(ws_cuda_event *event, ws_cuda_stream *stream) {
  ws_clear_error();
  void *raw = NULL;
  int previous = 0;
  int status = ws_cuda_enter_stream(stream, event->device, &raw, &previous);
  if (status != WS_OK)
    return status;
  cudaError_t error = cudaEventRecord(event->event, (cudaStream_t)raw);
  ws_cuda_leave(previous);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, "cudaEventRecord", "event on device %d",
                           event->device);
  return WS_OK;
}

int ws_cuda_event_query(ws_cuda_event *event, int *done) {
  ws_clear_error();
  cudaError_t error = cudaEventQuery(event->event);
  if (error == cudaSuccess || error == cudaErrorNotReady) {
    *done = error == cudaSuccess;
    return WS_OK;
  }
  return ws_cuda_failure(error, "cudaEventQuery", "event on device %d",
                         event->device);
}

int ws_cuda_event_synchronize(ws_cuda_event *event) {
  ws_clear_error();
  cudaError_t error = cudaEventSynchronize(event->event);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, "cudaEventSynchronize", "event on device %d",
                           event->device);
  return WS_OK;
}

int ws_cuda_event_elapsed(const ws_cuda_event *start, const ws_cuda_event *end,
                          double *milliseconds) {
  ws_clear_error();
  float elapsed = 0;
  cudaError_t error = cudaEventElapsedTime(&elapsed, start->event, end->event);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, "cudaEventElapsedTime",
                           "events on device %d", start->device);
  *milliseconds = elapsed;
  return WS_OK;
}

int ws_cuda_event_destroy(ws_cuda_event *event) {
  ws_clear_error();
  if (event == NULL)
    return WS_OK;
  cudaError_t error = cudaEventDestroy(event->event);
  int device = event->device;
  free(event);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, "cudaEventDestroy", "event on device %d",
                           device);
  return WS_OK;
}

// ---------------------------------------------------------------------------
// Small copies and fills

// Checks the range and the region, enters its device and resolves the stream.
static int begin_transfer(const ws_cuda_region *region, uint64_t offset,
                          uint64_t length, ws_cuda_stream *stream,
                          const char *what, int *previous, void **raw) {
  int status = check_range(region, offset, length, what);
  if (status != WS_OK)
    return status;
  status = ws_cuda_enter_stream(stream, region->device, raw, previous);
  if (status != WS_OK)
    return status;
  status = ws_cuda_check_region(region, region->device, what, 0);
  if (status != WS_OK)
    ws_cuda_leave(*previous);
  return status;
}

static int copy_and_wait(void *to, const void *from, size_t length,
                         enum cudaMemcpyKind kind, ws_cuda_stream *stream,
                         void *raw, const char *what) {
  cudaError_t error = cudaMemcpyAsync(to, from, length, kind, (cudaStream_t)raw);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, "cudaMemcpyAsync", "%s of %zu bytes", what,
                           length);
  return ws_cuda_wait((cudaStream_t)raw, stream != NULL ? stream->done : NULL,
                  what);
}

static int transfer(const ws_cuda_region *region, uint64_t offset,
                    uint64_t length, ws_cuda_stream *stream,
                    transfer_kind kind, const void *from_host, void *to_host,
                    int value) {
  ws_clear_error();
  const char *what = transfer_names[kind];
  int previous = 0;
  void *raw = NULL;
  int status = begin_transfer(region, offset, length, stream, what, &previous,
                              &raw);
  if (status != WS_OK)
    return status;
  char *device = (char *)(uintptr_t)region->pointer + offset;
  if (kind == TRANSFER_MEMSET) {
    cudaError_t error =
        cudaMemsetAsync(device, value, length, (cudaStream_t)raw);
    if (error != cudaSuccess)
      status = ws_cuda_failure(error, "cudaMemsetAsync", "memset of %llu bytes",
                               (unsigned long long)length);
  } else if (length > 0 && kind == TRANSFER_WRITE) {
    status = copy_and_wait(device, from_host, length, cudaMemcpyHostToDevice,
                           stream, raw, what);
  } else if (length > 0) {
    status = copy_and_wait(to_host, device, length, cudaMemcpyDeviceToHost,
                           stream, raw, what);
  }
  ws_cuda_leave(previous);
  return status;
}

int ws_cuda_memcpy(const ws_cuda_region *target, uint64_t target_offset,
                   const ws_cuda_region *source, uint64_t source_offset,
                   uint64_t length, ws_cuda_stream *stream) {
  ws_clear_error();
  int status = check_range(source, source_offset, length, "memcpy source");
  if (status != WS_OK)
    return status;
  int previous = 0;
  void *raw = NULL;
  status = begin_transfer(target, target_offset, length, stream,
                          "memcpy target", &previous, &raw);
  if (status != WS_OK)
    return status;
  status = ws_cuda_check_region(source, source->device, "memcpy source", 0);
  if (status == WS_OK && length > 0) {
    cudaError_t error = cudaMemcpyAsync(
        (char *)(uintptr_t)target->pointer + target_offset,
        (const char *)(uintptr_t)source->pointer + source_offset, length,
        cudaMemcpyDeviceToDevice, (cudaStream_t)raw);
    if (error != cudaSuccess)
      status = ws_cuda_failure(error, "cudaMemcpyAsync",
                               "device copy of %llu bytes",
                               (unsigned long long)length);
  }
  ws_cuda_leave(previous);
  return status;
}

#else // !WSYNC_WITH_CUDA

static int not_built(void) {
  return ws_fail(WS_ENODEV, "cuda backend: this wsync was built without CUDA");
}

int ws_cuda_buffer_create(int device, size_t size, ws_cuda_buffer **out) {
  ws_clear_error();
  (void)device, (void)out;
  if (size == 0)
    return ws_fail(WS_EINVAL, "cuda: a buffer needs a positive size");
  return not_built();
}

int ws_cuda_buffer_export(ws_cuda_buffer *buffer, unsigned char *handle_out) {
  ws_clear_error();
  (void)buffer, (void)handle_out;
  return not_built();
}

int ws_cuda_export_region(const ws_cuda_region *region,
                          unsigned char *handle_out, uint64_t *allocation_size,
                          uint64_t *offset) {
  ws_clear_error();
  (void)region, (void)handle_out, (void)allocation_size, (void)offset;
  return not_built();
}

void ws_cuda_buffer_region(const ws_cuda_buffer *buffer, ws_cuda_region *out) {
  (void)buffer;
  memset(out, 0, sizeof *out);
}

int ws_cuda_buffer_close(ws_cuda_buffer *buffer) {
  ws_clear_error();
  return buffer == NULL ? WS_OK : not_built();
}

int ws_cuda_mapping_open(int device, const unsigned char *handle, size_t size,
                         ws_cuda_mapping **out) {
  ws_clear_error();
  (void)device, (void)handle, (void)out;
  if (size == 0)
    return ws_fail(WS_EINVAL, "cuda: an imported buffer needs a positive size");
  return not_built();
}

void ws_cuda_mapping_region(const ws_cuda_mapping *mapping,
                            ws_cuda_region *out) {
  (void)mapping;
  memset(out, 0, sizeof *out);
}

int ws_cuda_mapping_close(ws_cuda_mapping *mapping) {
  ws_clear_error();
  return mapping == NULL ? WS_OK : not_built();
}

int ws_cuda_stream_create(int device, ws_cuda_stream **out) {
  ws_clear_error();
  (void)device, (void)out;
  return not_built();
}

int ws_cuda_stream_device(const ws_cuda_stream *stream) {
  (void)stream;
  return -1;
}

void *ws_cuda_stream_handle(const ws_cuda_stream *stream) {
  (void)stream;
  return NULL;
}

int ws_cuda_stream_synchronize(ws_cuda_stream *stream) {
  ws_clear_error();
  (void)stream;
  return not_built();
}

int ws_cuda_stream_destroy(ws_cuda_stream *stream) {
  ws_clear_error();
  return stream == NULL ? WS_OK : not_built();
}

static int stream_value(ws_cuda_stream *stream, const ws_cuda_region *region,
                        uint64_t offset, uint32_t value, int write) {
  ws_clear_error();
  (void)stream, (void)region, (void)offset, (void)value, (void)write;
  return not_built();
}

int ws_cuda_event_create(int device, int timing, ws_cuda_event **out) {
  ws_clear_error();
  (void)device, (void)timing, (void)out;
  return not_built();
}

int ws_cuda_event_record(ws_cuda_event *event, ws_cuda_stream *stream) {
  ws_clear_error();
  (void)event, (void)stream;
  return not_built();
}

int ws_cuda_event_query(ws_cuda_event *event, int *done) {
  ws_clear_error();
  (void)event, (void)done;
  return not_built();
}

int ws_cuda_event_synchronize(ws_cuda_event *event) {
  ws_clear_error();
  (void)event;
  return not_built();
}

int ws_cuda_event_elapsed(const ws_cuda_event *start, const ws_cuda_event *end,
                          double *milliseconds) {
  ws_clear_error();
  (void)start, (void)end, (void)milliseconds;
  return not_built();
}

int ws_cuda_event_destroy(ws_cuda_event *event) {
  ws_clear_error();
  return event == NULL ? WS_OK : not_built();
}

static int transfer(const ws_cuda_region *region, uint64_t offset,
                    uint64_t length, ws_cuda_stream *stream,
                    transfer_kind kind, const void *from_host, void *to_host,
                    int value) {
  ws_clear_error();
  (void)stream, (void)from_host, (void)to_host, (void)value;
  int status = check_range(region, offset, length, transfer_names[kind]);
  return status != WS_OK ? status : not_built();
}

int ws_cuda_memcpy(const ws_cuda_region *target, uint64_t target_offset,
                   const ws_cuda_region *source, uint64_t source_offset,
                   uint64_t length, ws_cuda_stream *stream) {
  ws_clear_error();
  (void)target, (void)target_offset, (void)source, (void)source_offset;
  (void)length, (void)stream;
  return not_built();
}

void ws_cuda_counters_get(ws_cuda_counters *out) {
  memset(out, 0, sizeof *out);
}

#endif

int ws_cuda_stream_wait_value(ws_cuda_stream *stream,
                              const ws_cuda_region *region, uint64_t offset,
                              uint32_t value) {
  return stream_value(stream, region, offset, value, 0);
}

int ws_cuda_stream_write_value(ws_cuda_stream *stream,
                               const ws_cuda_region *region, uint64_t offset,
                               uint32_t value) {
  return stream_value(stream, region, offset, value, 1);
}

int ws_cuda_write(const ws_cuda_region *region, uint64_t offset,
                  const void *bytes, size_t length, ws_cuda_stream *stream) {
  return transfer(region, offset, length, stream, TRANSFER_WRITE, bytes, NULL,
                  0);
}

int ws_cuda_read(const ws_cuda_region *region, uint64_t offset,
                 void *bytes_out, size_t length, ws_cuda_stream *stream) {
  return transfer(region, offset, length, stream, TRANSFER_READ, NULL,
                  bytes_out, 0);
}

int ws_cuda_memset(const ws_cuda_region *region, uint64_t offset,
                   uint64_t length, int value, ws_cuda_stream *stream) {
  return transfer(region, offset, length, stream, TRANSFER_MEMSET, NULL, NULL,
                  value);
}

static int check_range(const ws_cuda_region *region, uint64_t offset,
                       uint64_t length, const char *what) {
  if (offset > region->size || length > region->size - offset)
    return ws_fail(WS_EINVAL,
                   "cuda: %s range [%llu, +%llu) exceeds the %llu-byte region",
                   what, (unsigned long long)offset,
                   (unsigned long long)length,
                   (unsigned long long)region->size);
  return WS_OK;
}
