// Device memory of a GPU as its driver sees it, through NVML: what is in use on
// the whole device and by each process on it. Asking makes no CUDA context, so
// the host can watch every device of a run (the memory schedule's report)
// without holding memory on them. NVML (libnvidia-ml.so.1, part of the
// driver) is opened with dlopen on first use; a machine without it answers
// WS_ENODEV with the reason.
#pragma once

#include "status_defs.h"

#ifndef WS_FFI
#include <stdint.h>
#endif

enum {
  WS_GPU_PROCESS_MAX = 64,
};

/// One process with memory on the device, as NVML lists it (pid as the
/// driver knows it: in a container of its own pid namespace, not the
/// caller's).
typedef struct ws_gpu_process {
  uint32_t pid;
  uint64_t used_bytes; // UINT64_MAX: the driver does not say
} ws_gpu_process;

/// A device's memory, whole and by process.
typedef struct ws_gpu_memory {
  uint64_t total_bytes; // what processes can hold: the driver's reserve left
                        // out where NVML names it (as CUDA's total does)
  uint64_t used_bytes;  // total less free
  uint64_t free_bytes;
  uint64_t reserved_bytes; // the driver's own (0: an NVML without
                           // nvmlDeviceGetMemoryInfo_v2, whose total and
                           // used count it)
  int process_count; // -1: NVML could not list them
  ws_gpu_process processes[WS_GPU_PROCESS_MAX];
} ws_gpu_memory;

/// Fills `*out` for the GPU whose UUID is `uuid` (wsync's form, as
/// ws_device_query gives it: lowercase 8-4-4-4-12).
int ws_gpu_memory_query(const char *uuid, ws_gpu_memory *out);
