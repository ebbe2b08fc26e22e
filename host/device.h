// Device identity and memory for the two backends.
//
// `host`: synthetic devices, one per trainer rank; the identity is derived from
// the machine id and the index, written as a UUID, so it is stable per machine.
// `cuda`: real GPUs through the CUDA runtime; the identity is the UUID from
// cudaGetDeviceProperties written like torch does (lowercase 8-4-4-4-12, no
// "GPU-" prefix). A build without CUDA, or a machine without a driver, answers
// WS_ENODEV with the reason.
#pragma once

#include "status_defs.h"

#ifndef WS_FFI
#include <stdint.h>
#endif

/// Which data plane a device belongs to.
typedef enum ws_backend {
  WS_BACKEND_HOST = 0,
  WS_BACKEND_CUDA = 1,
} ws_backend;

enum {
  WS_UUID_LENGTH = 36,
  WS_DEVICE_NAME_MAX = 96,
  WS_HOST_DEVICE_MAX = 64,
};

/// What the host knows about one device.
typedef struct ws_device_info {
  int index;
  char uuid[WS_UUID_LENGTH + 1];
  char name[WS_DEVICE_NAME_MAX];
  uint64_t total_bytes;
  uint64_t free_bytes;
} ws_device_info;

/// Stores the number of devices of a backend in `*count`.
int ws_device_count(ws_backend backend, int *count);

/// Fills `*info` for device `index` of a backend: identity, name and memory.
int ws_device_query(ws_backend backend, int index, ws_device_info *info);

/// Returns 1 when this binary was built with CUDA support, 0 otherwise.
int ws_device_cuda_built(void);
