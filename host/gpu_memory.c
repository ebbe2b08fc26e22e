#include "gpu_memory.h"

#include "library.h"
#include "status.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// NVML's ABI as wsync uses it (stable since driver 510): results are
// int-sized enums, a device is a pointer, and these structs. Version 1 of
// the memory info counts what the driver reserves for itself in total and
// in used; version 2 names it apart (a version word first: the struct's size
// and 2 << 24).
typedef void *nvml_device;
typedef struct nvml_memory {
  unsigned long long total, free, used;
} nvml_memory;
typedef struct nvml_memory_v2 {
  unsigned int version;
  unsigned long long total, reserved, free, used;
} nvml_memory_v2;
typedef struct nvml_process {
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id, compute_instance_id;
} nvml_process;

enum {
  NVML_SUCCESS = 0,
  NVML_ERROR_INSUFFICIENT_SIZE = 7,
  NVML_UUID_BUFFER = 96,
};

static struct {
  int (*init)(void);
  int (*device_by_uuid)(const char *uuid, nvml_device *device);
  int (*memory_info)(nvml_device device, nvml_memory *memory);
  int (*memory_info_v2)(nvml_device device,
                        nvml_memory_v2 *memory); // optional
  int (*compute_processes)(nvml_device device, unsigned int *count,
                           nvml_process *processes); // optional
  const char *(*error_string)(int result);
} nvml;

static ws_library_symbol nvml_symbols[] = {
    {"nvmlInit_v2", (void **)&nvml.init, 1},
    {"nvmlDeviceGetHandleByUUID", (void **)&nvml.device_by_uuid, 1},
    {"nvmlDeviceGetMemoryInfo", (void **)&nvml.memory_info, 1},
    {"nvmlDeviceGetMemoryInfo_v2", (void **)&nvml.memory_info_v2, 0},
    {"nvmlDeviceGetComputeRunningProcesses_v3",
     (void **)&nvml.compute_processes, 0},
    {"nvmlErrorString", (void **)&nvml.error_string, 1},
};

// NVML's initialization, once its functions are found.
static int start_nvml(const char *path, char *detail, size_t size) {
  (void)path;
  int result = nvml.init();
  if (result != NVML_SUCCESS) {
    snprintf(detail, size, "nvml: nvmlInit_v2 failed: %s",
             nvml.error_string(result));
    return WS_ENODEV;
  }
  return WS_OK;
}

static ws_library library = {
    .prefix = "nvml",
    .variable = "WSYNC_NVML_LIBRARY",
    .default_path = "libnvidia-ml.so.1",
    .purpose = "the NVIDIA driver's library, for device memory",
    .symbols = nvml_symbols,
    .count = sizeof nvml_symbols / sizeof nvml_symbols[0],
    .start = start_nvml,
    .lock = PTHREAD_MUTEX_INITIALIZER,
};

// The device's memory into `out`: with version 2, the driver's reserve kept
// out of total and used (what processes can hold, as CUDA counts its total);
// with version 1 only, inside both (reserved_bytes 0: not known).
static int read_memory(nvml_device device, ws_gpu_memory *out) {
  if (nvml.memory_info_v2 != NULL) {
    nvml_memory_v2 memory = {.version = sizeof(nvml_memory_v2) | 2u << 24};
    if (nvml.memory_info_v2(device, &memory) == NVML_SUCCESS &&
        memory.reserved <= memory.total &&
        memory.free <= memory.total - memory.reserved) {
      out->total_bytes = memory.total - memory.reserved;
      out->reserved_bytes = memory.reserved;
      out->free_bytes = memory.free;
      out->used_bytes = out->total_bytes - memory.free;
      return NVML_SUCCESS;
    }
  }
  nvml_memory memory;
  int result = nvml.memory_info(device, &memory);
  if (result != NVML_SUCCESS)
    return result;
  out->total_bytes = memory.total;
  out->free_bytes = memory.free;
  out->used_bytes = memory.total - memory.free;
  return NVML_SUCCESS;
}

int ws_gpu_memory_query(const char *uuid, ws_gpu_memory *out) {
  ws_clear_error();
  if (uuid == NULL || out == NULL)
    return ws_fail(WS_EINVAL, "nvml: a device's UUID and a result are needed");
  int status = ws_library_load(&library);
  if (status != WS_OK)
    return status;
  char name[NVML_UUID_BUFFER];
  if (snprintf(name, sizeof name, "GPU-%s", uuid) >= (int)sizeof name)
    return ws_fail(WS_EINVAL, "nvml: device UUID '%.40s...' is too long", uuid);
  nvml_device device = NULL;
  int result = nvml.device_by_uuid(name, &device);
  if (result != NVML_SUCCESS)
    return ws_fail(WS_ENOTFOUND, "nvml: no GPU %s: %s", name,
                   nvml.error_string(result));
  memset(out, 0, sizeof *out);
  result = read_memory(device, out);
  if (result != NVML_SUCCESS)
    return ws_fail(WS_ENODEV, "nvml: nvmlDeviceGetMemoryInfo of %s: %s", name,
                   nvml.error_string(result));
  out->process_count = -1;
  if (nvml.compute_processes != NULL) {
    nvml_process processes[WS_GPU_PROCESS_MAX];
    unsigned int count = WS_GPU_PROCESS_MAX;
    result = nvml.compute_processes(device, &count, processes);
    if (result == NVML_SUCCESS) {
      out->process_count = (int)count;
      for (unsigned int i = 0; i < count; i++) {
        out->processes[i].pid = processes[i].pid;
        out->processes[i].used_bytes = processes[i].used_gpu_memory; // (~0: not known)
      }
    }
  }
  return WS_OK;
}
