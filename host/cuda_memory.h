// Device memory of the cuda backend: packed buffers from plain cudaMalloc
// (not VMM, not a caching allocator) exported once with cudaIpcGetMemHandle;
// IPC mappings opened once per buffer per process (cudaIpcOpenMemHandle) and
// kept until closed; streams and events for ordering and completion (events
// wait with cudaEventBlockingSync: no host spin loop); small host <-> device
// copies for tests and verify; and counters of the calls that matter for the
// steady state (a publication after the first opens no mapping).
//
// Every CUDA call is checked; a failure's detail names the call and CUDA's own
// error name and text ("cudaIpcOpenMemHandle: cudaErrorInvalidValue (invalid
// argument)"). A build without CUDA, or a machine without a driver or a
// device, answers WS_ENODEV with the reason. Functions that take a device
// switch to it for the call and switch back (the caller's current device, a
// trainer's torch device for one, is left as it was).
#pragma once

#include "status_defs.h"

#ifndef WS_FFI
#include <stddef.h>
#include <stdint.h>
#endif

enum { WS_CUDA_IPC_HANDLE_BYTES = 64 };

typedef struct ws_cuda_buffer ws_cuda_buffer;
typedef struct ws_cuda_mapping ws_cuda_mapping;
typedef struct ws_cuda_stream ws_cuda_stream;
typedef struct ws_cuda_event ws_cuda_event;

/// A range of device memory on one device: a buffer, a mapping, or memory
/// that someone else allocated (a trainer's tensor storage). Copy ops and
/// fills address it by offset, so that every range is checked before a kernel
/// runs.
typedef struct ws_cuda_region {
  uint64_t pointer; // device address of the first byte
  uint64_t size;    // bytes
  int32_t device;   // CUDA device index
  uint32_t reserved;
} ws_cuda_region;

/// Process-wide counts of the calls that the steady state must not repeat.
typedef struct ws_cuda_counters {
  uint64_t allocations;    // cudaMalloc calls that succeeded (buffers, plans)
  uint64_t frees;          // cudaFree calls for them
  uint64_t live_bytes;     // bytes allocated and not yet freed
  uint64_t exports;        // cudaIpcGetMemHandle calls
  uint64_t ipc_opens;      // cudaIpcOpenMemHandle calls that succeeded
  uint64_t ipc_closes;     // cudaIpcCloseMemHandle calls
  uint64_t mappings_reused; // opens answered by a mapping already open
  uint64_t live_mappings;  // mapped buffers now (each opened once)
  uint64_t launches;       // kernel launches (copy and synthetic plans)
} ws_cuda_counters;

/// Allocates `size` bytes on `device` with cudaMalloc, zero-filled.
int ws_cuda_buffer_create(int device, size_t size, ws_cuda_buffer **out);

/// Writes the buffer's 64-byte cudaIpcMemHandle_t into `handle_out`. The
/// first call exports it (cudaIpcGetMemHandle); later calls copy that handle.
int ws_cuda_buffer_export(ws_cuda_buffer *buffer, unsigned char *handle_out);

/// Exports the cudaMalloc allocation that holds `region` (memory this process
/// allocated some other way: a torch tensor's storage) for another process to
/// map with ws_cuda_mapping_open: its 64-byte handle into `handle_out`, the
/// allocation's size into `*allocation_size` and where the region starts in it
/// into `*offset`. Refused when the driver cannot say which allocation holds
/// the region, or when that allocation cannot be exported (VMM memory, as
/// torch's expandable segments make, has no cudaIpcMemHandle_t).
int ws_cuda_export_region(const ws_cuda_region *region,
                          unsigned char *handle_out, uint64_t *allocation_size,
                          uint64_t *offset);

/// Describes the whole buffer as a region.
void ws_cuda_buffer_region(const ws_cuda_buffer *buffer, ws_cuda_region *out);

/// Frees the buffer (cudaFree) and the object; NULL is accepted. Mappings in
/// other processes keep the memory alive until they close.
int ws_cuda_buffer_close(ws_cuda_buffer *buffer);

/// Maps the buffer another process exported as `handle` on `device`, of
/// `size` bytes (checked against the allocation's real size where the driver
/// tells it). A handle already mapped in this process shares that mapping
/// (counted in mappings_reused): cudaIpcOpenMemHandle runs once per buffer
/// per process, with cudaIpcMemLazyEnablePeerAccess.
int ws_cuda_mapping_open(int device, const unsigned char *handle, size_t size,
                         ws_cuda_mapping **out);

/// Describes the mapped buffer as a region.
void ws_cuda_mapping_region(const ws_cuda_mapping *mapping,
                            ws_cuda_region *out);

/// Releases this mapping and the object; the last one of a buffer calls
/// cudaIpcCloseMemHandle. NULL is accepted.
int ws_cuda_mapping_close(ws_cuda_mapping *mapping);

/// Creates a non-blocking stream on `device`.
int ws_cuda_stream_create(int device, ws_cuda_stream **out);

/// Returns the stream's device.
int ws_cuda_stream_device(const ws_cuda_stream *stream);

/// Returns the stream as a cudaStream_t, for handing to other CUDA code.
void *ws_cuda_stream_handle(const ws_cuda_stream *stream);

/// Waits until the work queued on the stream so far has finished, blocked in
/// the driver (an event with cudaEventBlockingSync), not spinning.
int ws_cuda_stream_synchronize(ws_cuda_stream *stream);

/// Destroys the stream (queued work still runs to its end); NULL is accepted.
int ws_cuda_stream_destroy(ws_cuda_stream *stream);

/// Queues on `stream` a wait of the device (not the host) until the 32-bit
/// word at `offset` of `region` holds `value` or later, compared cyclically
/// ((int32_t)(word - value) >= 0): work queued after it starts only then. The
/// word may lie in an IPC mapping of another process's buffer, so that one
/// process's stream waits for another's (cuStreamWaitValue32). WS_ENODEV
/// where the driver has no stream memory operations.
int ws_cuda_stream_wait_value(ws_cuda_stream *stream,
                              const ws_cuda_region *region, uint64_t offset,
                              uint32_t value);

/// Queues on `stream` a write of `value` to the 32-bit word at `offset` of
/// `region`, once the work queued before it finished, its writes visible
/// before the word (cuStreamWriteValue32).
int ws_cuda_stream_write_value(ws_cuda_stream *stream,
                               const ws_cuda_region *region, uint64_t offset,
                               uint32_t value);

/// Creates an event on `device` that waits without spinning; `timing` non-zero
/// lets ws_cuda_event_elapsed measure between two of them.
int ws_cuda_event_create(int device, int timing, ws_cuda_event **out);

/// Records the event on `stream` (NULL: the device's legacy default stream).
int ws_cuda_event_record(ws_cuda_event *event, ws_cuda_stream *stream);

/// Stores 1 in `*done` when the work before the last record has finished, 0
/// while it runs.
int ws_cuda_event_query(ws_cuda_event *event, int *done);

/// Waits until the work before the last record has finished, without
/// spinning.
int ws_cuda_event_synchronize(ws_cuda_event *event);

/// Stores the milliseconds between two recorded, finished timing events.
int ws_cuda_event_elapsed(const ws_cuda_event *start, const ws_cuda_event *end,
                          double *milliseconds);

/// Destroys the event; NULL is accepted.
int ws_cuda_event_destroy(ws_cuda_event *event);

/// Copies `length` host bytes to `offset` in `region`, ordered on `stream`
/// (NULL: legacy default stream), and returns once they are in place.
int ws_cuda_write(const ws_cuda_region *region, uint64_t offset,
                  const void *bytes, size_t length, ws_cuda_stream *stream);

/// Copies `length` bytes at `offset` in `region` to host memory, ordered on
/// `stream` (NULL: legacy default stream), and returns once they are there.
int ws_cuda_read(const ws_cuda_region *region, uint64_t offset,
                 void *bytes_out, size_t length, ws_cuda_stream *stream);

/// Queues a fill of `length` bytes at `offset` in `region` with `value` on
/// `stream` (NULL: legacy default stream).
int ws_cuda_memset(const ws_cuda_region *region, uint64_t offset,
                   uint64_t length, int value, ws_cuda_stream *stream);

/// Queues one device-to-device cudaMemcpyAsync of `length` bytes on `stream`
/// (the copy engine's path: the benchmark's floor, not the data path).
int ws_cuda_memcpy(const ws_cuda_region *target, uint64_t target_offset,
                   const ws_cuda_region *source, uint64_t source_offset,
                   uint64_t length, ws_cuda_stream *stream);

/// Copies the process-wide counters into `*out`.
void ws_cuda_counters_get(ws_cuda_counters *out);
