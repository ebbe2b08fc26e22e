#include "device.h"

#include "digest.h"
#include "status.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#ifdef WSYNC_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

static void format_uuid(const unsigned char bytes[16], char *out) {
  static const int group_ends[] = {4, 6, 8, 10};
  static const char hex_digits[] = "0123456789abcdef";
  int position = 0, group = 0;
  for (int i = 0; i < 16; i++) {
    if (group < 4 && i == group_ends[group]) {
      out[position++] = '-';
      group++;
    }
    out[position++] = hex_digits[bytes[i] >> 4];
    out[position++] = hex_digits[bytes[i] & 15];
  }
  out[position] = '\0';
}

static int read_machine_id(char *out, size_t size) {
  const char *paths[] = {"/etc/machine-id", "/var/lib/dbus/machine-id"};
  for (size_t i = 0; i < sizeof paths / sizeof paths[0]; i++) {
    FILE *file = fopen(paths[i], "r");
    if (file == NULL)
      continue;
    int found = fgets(out, (int)size, file) != NULL;
    fclose(file);
    if (found) {
      out[strcspn(out, "\n")] = '\0';
      return WS_OK;
    }
  }
  if (gethostname(out, size) != 0)
    snprintf(out, size, "unknown-machine");
  return WS_OK;
}

static int query_host(int index, ws_device_info *info) {
  if (index < 0 || index >= WS_HOST_DEVICE_MAX)
    return ws_fail(WS_EINVAL, "host backend: device %d out of range 0..%d",
                   index, WS_HOST_DEVICE_MAX - 1);
  char seed[160];
  read_machine_id(seed, 128);
  size_t used = strlen(seed);
  snprintf(seed + used, sizeof seed - used, "/wsync-host-device/%d", index);
  unsigned char digest[WS_SHA256_BYTES];
  int status = ws_sha256(seed, strlen(seed), digest);
  if (status != WS_OK)
    return status;
  digest[6] = (digest[6] & 0x0f) | 0x80; // a name-based UUID (version 8)
  digest[8] = (digest[8] & 0x3f) | 0x80; // RFC 4122 variant
  memset(info, 0, sizeof *info);
  info->index = index;
  format_uuid(digest, info->uuid);
  snprintf(info->name, sizeof info->name, "host%d", index);
  long pages = sysconf(_SC_PHYS_PAGES);
  long available = sysconf(_SC_AVPHYS_PAGES);
  long page_size = sysconf(_SC_PAGESIZE);
  info->total_bytes = pages > 0 ? (uint64_t)pages * (uint64_t)page_size : 0;
  info->free_bytes =
      available > 0 ? (uint64_t)available * (uint64_t)page_size : 0;
  return WS_OK;
}

#ifdef WSYNC_WITH_CUDA
static int cuda_failure(cudaError_t error, const char *call) {
  int status = (error == cudaErrorNoDevice ||
                error == cudaErrorInsufficientDriver)
                   ? WS_ENODEV
                   : WS_ECUDA;
  return ws_fail(status, "cuda backend: %s: %s (%s)", call,
                 cudaGetErrorName(error), cudaGetErrorString(error));
}

static int count_cuda(int *count) {
  cudaError_t error = cudaGetDeviceCount(count);
  if (error != cudaSuccess)
    return cuda_failure(error, "cudaGetDeviceCount");
  return WS_OK;
}

static int query_cuda(int index, ws_device_info *info) {
  int count = 0;
  int status = count_cuda(&count);
  if (status != WS_OK)
    return status;
  if (index < 0 || index >= count)
    return ws_fail(WS_EINVAL, "cuda backend: device %d out of range (%d visible)",
                   index, count);
  struct cudaDeviceProp properties;
  cudaError_t error = cudaGetDeviceProperties(&properties, index);
  if (error != cudaSuccess)
    return cuda_failure(error, "cudaGetDeviceProperties");
  memset(info, 0, sizeof *info);
  info->index = index;
  format_uuid((const unsigned char *)properties.uuid.bytes, info->uuid);
  snprintf(info->name, sizeof info->name, "%.*s", WS_DEVICE_NAME_MAX - 1,
           properties.name);

  int previous = 0;
  error = cudaGetDevice(&previous);
  if (error == cudaSuccess)
    error = cudaSetDevice(index);
  size_t free_bytes = 0, total_bytes = 0;
  if (error == cudaSuccess)
    error = cudaMemGetInfo(&free_bytes, &total_bytes);
  cudaSetDevice(previous);
  if (error != cudaSuccess)
    return cuda_failure(error, "cudaMemGetInfo");
  info->free_bytes = free_bytes;
  info->total_bytes = total_bytes;
  return WS_OK;
}
#else
static int count_cuda(int *count) {
  *count = 0;
  return ws_fail(WS_ENODEV, "cuda backend: this wsync was built without CUDA");
}

static int query_cuda(int index, ws_device_info *info) {
  (void)index;
  (void)info;
  return count_cuda(&index);
}
#endif

int ws_device_count(ws_backend backend, int *count) {
  ws_clear_error();
  switch (backend) {
  case WS_BACKEND_HOST:
    *count = WS_HOST_DEVICE_MAX;
    return WS_OK;
  case WS_BACKEND_CUDA:
    return count_cuda(count);
  }
  return ws_fail(WS_EINVAL, "unknown backend %d", (int)backend);
}

int ws_device_query(ws_backend backend, int index, ws_device_info *info) {
  ws_clear_error();
  switch (backend) {
  case WS_BACKEND_HOST:
    return query_host(index, info);
  case WS_BACKEND_CUDA:
    return query_cuda(index, info);
  }
  return ws_fail(WS_EINVAL, "unknown backend %d", (int)backend);
}

int ws_device_cuda_built(void) {
#ifdef WSYNC_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}
