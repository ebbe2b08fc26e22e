#include "gpu_memory.h"

#include "status.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// NVML's ABI as wsync uses it (stable since driver 510): results are
// int-sized enums, a device is a pointer, and these two structs.
typedef void *nvml_device;
typedef struct nvml_memory {
  unsigned long long total, free, used;
} nvml_memory;
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
  int (*compute_processes)(nvml_device device, unsigned int *count,
                           nvml_process *processes); // optional
  const char *(*error_string)(int result);
} nvml;
static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static int load_status;
static char load_detail[512];

static void load_library(void) {
  const char *path = getenv("WSYNC_NVML_LIBRARY");
  if (path == NULL || path[0] == '\0')
    path = "libnvidia-ml.so.1";
  void *library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (library == NULL) {
    const char *why = dlerror();
    load_status = WS_ENODEV;
    snprintf(load_detail, sizeof load_detail,
             "nvml: cannot load %s (the NVIDIA driver's library, for device "
             "memory): %s",
             path, why != NULL ? why : "unknown reason");
    return;
  }
  struct {
    const char *name;
    void **slot;
    int required;
  } symbols[] = {
      {"nvmlInit_v2", (void **)&nvml.init, 1},
      {"nvmlDeviceGetHandleByUUID", (void **)&nvml.device_by_uuid, 1},
      {"nvmlDeviceGetMemoryInfo", (void **)&nvml.memory_info, 1},
      {"nvmlDeviceGetComputeRunningProcesses_v3",
       (void **)&nvml.compute_processes, 0},
      {"nvmlErrorString", (void **)&nvml.error_string, 1},
  };
  for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
    *symbols[i].slot = dlsym(library, symbols[i].name);
    if (*symbols[i].slot == NULL && symbols[i].required) {
      load_status = WS_ENODEV;
      snprintf(load_detail, sizeof load_detail, "nvml: %s has no %s", path,
               symbols[i].name);
      memset(&nvml, 0, sizeof nvml);
      dlclose(library);
      return;
    }
  }
  int result = nvml.init();
  if (result != NVML_SUCCESS) {
    load_status = WS_ENODEV;
    snprintf(load_detail, sizeof load_detail, "nvml: nvmlInit_v2 failed: %s",
             nvml.error_string(result));
    memset(&nvml, 0, sizeof nvml);
    dlclose(library);
    return;
  }
  load_status = WS_OK; // loaded and initialized for the process
}

int ws_gpu_memory_query(const char *uuid, ws_gpu_memory *out) {
  ws_clear_error();
  if (uuid == NULL || out == NULL)
    return ws_fail(WS_EINVAL, "nvml: a device's UUID and a result are needed");
  pthread_once(&load_once, load_library);
  if (load_status != WS_OK)
    return ws_fail(load_status, "%s", load_detail);
  char name[NVML_UUID_BUFFER];
  if (snprintf(name, sizeof name, "GPU-%s", uuid) >= (int)sizeof name)
    return ws_fail(WS_EINVAL, "nvml: device UUID '%.40s...' is too long", uuid);
  nvml_device device = NULL;
  int result = nvml.device_by_uuid(name, &device);
  if (result != NVML_SUCCESS)
    return ws_fail(WS_ENOTFOUND, "nvml: no GPU %s: %s", name,
                   nvml.error_string(result));
  nvml_memory memory;
  result = nvml.memory_info(device, &memory);
  if (result != NVML_SUCCESS)
    return ws_fail(WS_ENODEV, "nvml: nvmlDeviceGetMemoryInfo of %s: %s", name,
                   nvml.error_string(result));
  memset(out, 0, sizeof *out);
  out->total_bytes = memory.total;
  out->free_bytes = memory.free;
  out->used_bytes = memory.total - memory.free;
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
