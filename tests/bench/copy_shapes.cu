// Benchmark: loop shapes for the batched copy kernel (host/cuda_kernels.cu)
// against cudaMemcpyAsync, on one flat device-to-device copy, in one run.
//
//   wsync_copy_shapes [GIB] [DEVICE]
//       GIB     bytes to copy, in GiB (default 8: one chunk of 8 GiB buffers)
//       DEVICE  CUDA device index (default 0)
//
// The production kernel gives each warp one contiguous range of the bytes
// and reaches 0.87-0.90 of cudaMemcpyAsync (tests/bench/RESULTS.md). Each
// shape below changes one thing, so that the row that closes the gap names
// what to change in the kernel:
//   range    each warp its own contiguous range (the kernel's shape), with
//            4 or 8 16-byte loads in flight per lane, its start rotated
//            (every warp at another offset of its range at a time), or with
//            streaming cache hints;
//   stride   warps take tiles of 32 lanes x U x 16 bytes in turn over the
//            whole copy (neighbouring warps on neighbouring bytes), at 4 or
//            8 blocks of 256 threads per multiprocessor;
//   runs     the same with runs of G tiles per warp.
// Each row is the best of 5 timed copies after one warm-up, on one stream,
// timed with events; rates count bytes read plus written. Not a test: it
// checks nothing but the CUDA calls.
#include <cuda_runtime.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

namespace {

enum Hint { kPlain, kStreaming, kReadOnly, kNoAllocate };

void check(cudaError_t error, const char *call) {
  if (error != cudaSuccess) {
    fprintf(stderr, "copy_shapes: %s: %s (%s)\n", call, cudaGetErrorName(error),
            cudaGetErrorString(error));
    exit(1);
  }
}

template <Hint H> __device__ __forceinline__ uint4 load(const uint4 *from) {
  if (H == kStreaming)
    return __ldcs(from);
  if (H == kReadOnly)
    return __ldg(from);
  if (H == kNoAllocate) {
    uint4 value;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(value.x), "=r"(value.y), "=r"(value.z), "=r"(value.w)
                 : "l"(from));
    return value;
  }
  return *from;
}

template <Hint H> __device__ __forceinline__ void store(uint4 *to, uint4 value) {
  if (H == kStreaming || H == kNoAllocate)
    __stcs(to, value);
  else
    *to = value;
}

// Units [begin, end) of 16 bytes, the lanes striding, U loads in flight.
template <int U, Hint H>
__device__ __forceinline__ void copy_units(const uint4 *from, uint4 *to,
                                           uint64_t begin, uint64_t end,
                                           unsigned lane) {
  uint64_t i = begin + lane;
  for (; i + (U - 1) * 32 < end; i += U * 32) {
    uint4 value[U];
#pragma unroll
    for (int k = 0; k < U; k++)
      value[k] = load<H>(from + i + k * 32);
#pragma unroll
    for (int k = 0; k < U; k++)
      store<H>(to + i + k * 32, value[k]);
  }
  for (; i < end; i += 32)
    to[i] = from[i];
}

// Warp w copies its own range of the `units`; with `rotate`, it starts
// `rotate` x w units into it and wraps around.
template <int U, Hint H>
__global__ void __launch_bounds__(256, 4)
    range_kernel(const uint4 *from, uint4 *to, uint64_t units, uint32_t warps,
                 uint64_t rotate) {
  uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  unsigned lane = threadIdx.x % 32;
  if (warp >= warps)
    return;
  uint64_t share = (units + warps - 1) / warps;
  uint64_t begin = warp * share, end = begin + share < units ? begin + share : units;
  if (begin >= end)
    return;
  uint64_t turn = rotate ? (warp * rotate) % (end - begin) & ~(uint64_t)31 : 0;
  copy_units<U, H>(from, to, begin + turn, end, lane);
  copy_units<U, H>(from, to, begin, begin + turn, lane);
}

// Tiles of G x U x 32 units; warp w takes tiles w, w + warps, ...
template <int U, Hint H, int G, int BLOCKS>
__global__ void __launch_bounds__(256, BLOCKS)
    tile_kernel(const uint4 *from, uint4 *to, uint64_t units, uint32_t warps) {
  uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  unsigned lane = threadIdx.x % 32;
  const uint64_t tile = (uint64_t)G * U * 32;
  for (uint64_t begin = warp * tile; begin < units; begin += warps * tile)
    copy_units<U, H>(from, to, begin, begin + tile < units ? begin + tile : units,
                     lane);
}

struct Shape {
  const char *name;
  void (*launch)(const uint4 *, uint4 *, uint64_t, cudaStream_t, int);
};

void copy_engine(const uint4 *from, uint4 *to, uint64_t units,
                 cudaStream_t stream, int) {
  check(cudaMemcpyAsync(to, from, units * 16, cudaMemcpyDeviceToDevice, stream),
        "cudaMemcpyAsync");
}

template <int U, Hint H, int ROTATE>
void range(const uint4 *from, uint4 *to, uint64_t units, cudaStream_t stream,
           int processors) {
  uint32_t warps = processors * 4 * 8;
  range_kernel<U, H><<<processors * 4, 256, 0, stream>>>(
      from, to, units, warps, ROTATE ? 4099 * 32 : 0);
}

template <int U, Hint H, int G, int BLOCKS>
void tiles(const uint4 *from, uint4 *to, uint64_t units, cudaStream_t stream,
           int processors) {
  uint32_t warps = processors * BLOCKS * 8;
  tile_kernel<U, H, G, BLOCKS><<<processors * BLOCKS, 256, 0, stream>>>(
      from, to, units, warps);
}

const Shape kShapes[] = {
    {"cudaMemcpyAsync (the floor)", copy_engine},
    {"range, 4 in flight (the kernel's)", range<4, kPlain, 0>},
    {"range, 8 in flight", range<8, kPlain, 0>},
    {"range, rotated starts", range<4, kPlain, 1>},
    {"range, streaming hints", range<4, kStreaming, 0>},
    {"range, no L1 allocate + streaming store", range<4, kNoAllocate, 0>},
    {"stride 2 KiB tiles, 4 blocks/SM", tiles<4, kPlain, 1, 4>},
    {"stride 4 KiB tiles, 4 blocks/SM", tiles<8, kPlain, 1, 4>},
    {"stride 1 KiB tiles, 8 blocks/SM", tiles<2, kPlain, 1, 8>},
    {"stride 2 KiB tiles, 8 blocks/SM", tiles<4, kPlain, 1, 8>},
    {"stride 2 KiB tiles, streaming hints", tiles<4, kStreaming, 1, 4>},
    {"stride 2 KiB tiles, read-only loads", tiles<4, kReadOnly, 1, 4>},
    {"stride 2 KiB tiles, no L1 allocate", tiles<4, kNoAllocate, 1, 4>},
    {"stride 4 KiB tiles, streaming hints", tiles<8, kStreaming, 1, 4>},
    {"runs of 8 KiB", tiles<4, kPlain, 4, 4>},
    {"runs of 32 KiB", tiles<4, kPlain, 16, 4>},
    {"runs of 128 KiB", tiles<4, kPlain, 64, 4>},
    {"runs of 32 KiB, streaming hints", tiles<4, kStreaming, 16, 4>},
    {"cudaMemcpyAsync again", copy_engine},
};

} // namespace

int main(int argc, char **argv) {
  double gib = argc > 1 ? atof(argv[1]) : 8;
  int device = argc > 2 ? atoi(argv[2]) : 0;
  if (!(gib > 0)) {
    fprintf(stderr, "usage: wsync_copy_shapes [GIB] [DEVICE]\n");
    return 2;
  }
  uint64_t bytes = (uint64_t)(gib * 1073741824.0) & ~(uint64_t)4095;
  check(cudaSetDevice(device), "cudaSetDevice");
  int processors = 0;
  check(cudaDeviceGetAttribute(&processors, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute");
  cudaDeviceProp properties;
  check(cudaGetDeviceProperties(&properties, device), "cudaGetDeviceProperties");
  void *from = NULL, *to = NULL;
  check(cudaMalloc(&from, bytes), "cudaMalloc");
  check(cudaMalloc(&to, bytes), "cudaMalloc");
  check(cudaMemset(from, 1, bytes), "cudaMemset");
  check(cudaMemset(to, 0, bytes), "cudaMemset");
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  printf("copy_shapes: %s (device %d, %d multiprocessors), %.3f GB per copy\n\n",
         properties.name, device, processors, bytes / 1e9);
  printf("| %-42s | %8s | %10s | %8s |\n", "shape", "best ms", "TB/s (r+w)",
         "vs floor");
  printf("| %-42s | %8s | %10s | %8s |\n", "---", "---", "---", "---");
  float floor = 0;
  for (const Shape &shape : kShapes) {
    float best = 1e30f;
    for (int run = 0; run < 6; run++) {
      check(cudaEventRecord(start, stream), "cudaEventRecord");
      shape.launch((const uint4 *)from, (uint4 *)to, bytes / 16, stream, processors);
      check(cudaGetLastError(), "launch");
      check(cudaEventRecord(stop, stream), "cudaEventRecord");
      check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
      if (run > 0 && ms < best)
        best = ms;
    }
    if (floor == 0)
      floor = best;
    printf("| %-42s | %8.3f | %10.3f | %8.3f |\n", shape.name, best,
           2.0 * bytes / best / 1e9, floor / best);
  }
  check(cudaEventDestroy(start), "cudaEventDestroy");
  check(cudaEventDestroy(stop), "cudaEventDestroy");
  check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  check(cudaFree(from), "cudaFree");
  check(cudaFree(to), "cudaFree");
  return 0;
}
