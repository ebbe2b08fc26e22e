// The cuda backend's kernels: the batched copy of a copy plan, the
// synthetic fill and check of a synthetic plan and the FP8 transform of an
// FP8 plan (cuda_plan.h), and their launchers for cuda_plan.c.
//
// Both kernels give each warp a range of pieces (warp_start[w] ..
// warp_start[w + 1] - 1, laid out on the host so that every warp has the same
// bytes or elements) and let the warp's 32 lanes stride through one piece at
// a time. The tiled copy kernel instead lets the warps take tiles of the
// copy stream in turn (host/cuda_tiles.h), so that they work on neighbouring
// bytes at any moment.
#include "cuda_internal.h"
#include "cuda_tiles.h"
#include "hash.h"

#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr unsigned kWarp = WS_CUDA_WARP;
constexpr unsigned kUnroll = 4; // loads in flight per lane before the stores
constexpr unsigned kRowUnroll = 2; // the same for strided pieces
constexpr unsigned kAll = 0xffffffffu;

static_assert(WS_CUDA_THREADS % WS_CUDA_WARP == 0, "whole warps per block");

// Copies `count` values of T (both ends aligned to T), the lanes striding.
template <typename T>
__device__ __forceinline__ void copy_stretch(const T *__restrict__ from,
                                             T *__restrict__ to,
                                             uint32_t count, unsigned lane) {
  uint32_t i = lane;
  for (; i + (kUnroll - 1) * kWarp < count; i += kUnroll * kWarp) {
    T value[kUnroll];
#pragma unroll
    for (unsigned k = 0; k < kUnroll; k++)
      value[k] = from[i + k * kWarp];
#pragma unroll
    for (unsigned k = 0; k < kUnroll; k++)
      to[i + k * kWarp] = value[k];
  }
  for (; i < count; i += kWarp)
    to[i] = from[i];
}

// The widest unit (16, 8, 4, 2 or 1 bytes) that divides `bits`.
__device__ __forceinline__ unsigned unit_of(uint64_t bits) {
  return (bits & 15) == 0 ? 16 : (bits & 7) == 0 ? 8 : (bits & 3) == 0 ? 4
       : (bits & 1) == 0 ? 2 : 1;
}

// Runs `copy` with a value of the type `unit` bytes wide (16: uint4, 8:
// uint2, 4, 2, otherwise 1 byte): the one place the copies pick their unit.
template <typename Copy>
__device__ __forceinline__ void with_unit(unsigned unit, Copy copy) {
  switch (unit) {
  case 16:
    return copy(uint4{});
  case 8:
    return copy(uint2{});
  case 4:
    return copy(uint32_t{});
  case 2:
    return copy(uint16_t{});
  default:
    return copy(uint8_t{});
  }
}

// One contiguous piece: when both ends are misaligned alike, the head up to
// the target's next unit boundary and the tail go bytewise, the body in the
// widest unit their relative alignment allows.
__device__ void copy_contiguous(const char *source, char *target,
                                uint32_t length, unsigned lane) {
  unsigned unit = unit_of((uintptr_t)source ^ (uintptr_t)target);
  uint32_t head = (uint32_t)((unit - ((uintptr_t)target & (unit - 1))) &
                             (unit - 1));
  if (head > length)
    head = length;
  if (lane < head)
    target[lane] = source[lane];
  source += head;
  target += head;
  length -= head;
  uint32_t body = length & ~(uint32_t)(unit - 1);
  with_unit(unit, [&](auto value) {
    using T = decltype(value);
    copy_stretch(reinterpret_cast<const T *>(source),
                 reinterpret_cast<T *>(target), body / (uint32_t)sizeof(T),
                 lane);
  });
  uint32_t tail = length - body;
  if (lane < tail)
    target[body + lane] = source[body + lane];
}

// One strided piece of `rows` rows of `per_row` values of T: lane i takes
// values i, i + 32, ... of the piece, its row and column advanced without a
// division per value.
template <typename T>
__device__ void copy_rows_of(const char *source, char *target, uint32_t rows,
                             uint32_t per_row, uint64_t source_pitch,
                             uint64_t target_pitch, unsigned lane) {
  uint32_t total = rows * per_row;
  uint32_t step_rows = kWarp / per_row, step_columns = kWarp % per_row;
  uint32_t row = lane / per_row, column = lane % per_row;
  for (uint32_t i = lane; i < total; i += kRowUnroll * kWarp) {
    T value[kRowUnroll];
    uint32_t at_row[kRowUnroll], at_column[kRowUnroll];
#pragma unroll
    for (unsigned k = 0; k < kRowUnroll; k++) {
      at_row[k] = row;
      at_column[k] = column;
      if (i + k * kWarp < total)
        value[k] = reinterpret_cast<const T *>(
            source + (uint64_t)row * source_pitch)[column];
      column += step_columns;
      row += step_rows;
      if (column >= per_row) {
        column -= per_row;
        row++;
      }
    }
#pragma unroll
    for (unsigned k = 0; k < kRowUnroll; k++)
      if (i + k * kWarp < total)
        reinterpret_cast<T *>(target + (uint64_t)at_row[k] * target_pitch)
            [at_column[k]] = value[k];
  }
}

__device__ void copy_rows(const char *source, char *target, uint32_t rows,
                          uint32_t width, uint64_t source_pitch,
                          uint64_t target_pitch, unsigned lane) {
  unsigned unit = unit_of((uintptr_t)source | (uintptr_t)target | width |
                          source_pitch | target_pitch);
  with_unit(unit, [&](auto value) {
    using T = decltype(value);
    copy_rows_of<T>(source, target, rows, width / (uint32_t)sizeof(T),
                    source_pitch, target_pitch, lane);
  });
}

// One descriptor, or one part of a tiled walk: a contiguous stretch or whole
// strided rows.
__device__ __forceinline__ void copy_part(const ws_cuda_copy_desc &part,
                                          unsigned lane) {
  const char *source = reinterpret_cast<const char *>(part.source);
  char *target = reinterpret_cast<char *>(part.target);
  if (part.rows == 1)
    copy_contiguous(source, target, part.width, lane);
  else
    copy_rows(source, target, part.rows, part.width, part.source_pitch,
              part.target_pitch, lane);
}

// At least four blocks per SM (64 registers a thread): 32 warps, each with
// four 16-byte loads per lane in flight, cover the memory latency.
__global__ void __launch_bounds__(WS_CUDA_THREADS, 4)
    copy_kernel(const ws_cuda_copy_desc *__restrict__ descs,
                const uint32_t *__restrict__ warp_start, uint32_t warps) {
  uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
  unsigned lane = threadIdx.x % kWarp;
  if (warp >= warps)
    return; // the whole warp: blocks hold whole warps
  // Each lane loads one descriptor of a batch of 32 into the warp's part of
  // shared memory; the warp then copies them one after the other.
  __shared__ ws_cuda_copy_desc batches[WS_CUDA_THREADS / WS_CUDA_WARP][kWarp];
  ws_cuda_copy_desc *batch_descs = batches[threadIdx.x / kWarp];
  uint32_t first = warp_start[warp], end = warp_start[warp + 1];
  for (uint32_t batch = first; batch < end; batch += kWarp) {
    if (batch + lane < end)
      batch_descs[lane] = descs[batch + lane];
    __syncwarp();
    uint32_t count = end - batch < kWarp ? end - batch : kWarp;
    for (uint32_t j = 0; j < count; j++) {
      const ws_cuda_copy_desc desc = batch_descs[j];
      copy_part(desc, lane);
    }
    __syncwarp(); // every lane is done with the batch before the next one
  }
}

// Warp w of the grid's W copies tiles w, w + W, ... of the descriptors'
// stream; each tile's parts come from the descriptors it overlaps, found
// from the last tile's with one coalesced look at the next 32 starts.
__global__ void __launch_bounds__(WS_CUDA_THREADS, 4)
    tiled_copy_kernel(const ws_cuda_copy_desc *__restrict__ descs,
                      const uint64_t *__restrict__ starts, uint32_t count,
                      uint64_t tile) {
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
  const uint64_t warps = (uint64_t)gridDim.x * (blockDim.x / kWarp);
  const unsigned lane = threadIdx.x % kWarp;
  const uint64_t total = starts[count];
  uint32_t cursor = 0; // the last descriptor starting at or before `begin`
  for (uint64_t begin = warp * tile; begin < total; begin += warps * tile) {
    const uint64_t end = begin + tile < total ? begin + tile : total;
    for (;;) {
      uint32_t probe = cursor + 1 + lane;
      unsigned before =
          __ballot_sync(kAll, probe < count && starts[probe] <= begin);
      cursor += __popc(before); // (the starts ascend: a run of low lanes)
      if (before != kAll)
        break;
    }
    for (uint32_t i = cursor; i < count && starts[i] < end; i++) {
      const uint64_t start = starts[i], next = starts[i + 1];
      ws_cuda_copy_desc parts[3];
      unsigned n = ws_cuda_tile_parts(&descs[i], begin > start ? begin - start : 0,
                                      (end < next ? end : next) - start, parts);
      for (unsigned p = 0; p < n; p++)
        copy_part(parts[p], lane);
    }
  }
}

__device__ __forceinline__ uint32_t float_bits(uint64_t bits) {
  uint32_t sign = (uint32_t)(bits >> 63) << 31;
  uint32_t exponent = 119u + (uint32_t)(bits >> 40) % 9u; // bits >> 40 < 2^24
  uint32_t mantissa = (uint32_t)bits & 0x7fffffu;
  return sign | (exponent << 23) | mantissa;
}

__device__ __forceinline__ unsigned long long
warp_sum(unsigned long long value) {
  for (unsigned offset = kWarp / 2; offset > 0; offset /= 2)
    value += __shfl_xor_sync(kAll, value, offset);
  return value;
}

__device__ __forceinline__ unsigned long long
warp_min(unsigned long long value) {
  for (unsigned offset = kWarp / 2; offset > 0; offset /= 2) {
    unsigned long long other = __shfl_xor_sync(kAll, value, offset);
    value = other < value ? other : value;
  }
  return value;
}

// One lane's elements of one synthetic piece: lane i takes elements i, i +
// 32, ... of the piece, writes its value or (`check`) counts a mismatch and
// keeps the lowest (op << 40 | element) of those.
__device__ __forceinline__ void
synth_piece(const ws_cuda_synth_piece &piece, uint64_t version_mix, int check,
            unsigned lane, unsigned long long *mismatches,
            unsigned long long *first_bad) {
  const uint64_t key = ws_hash_mix(piece.seed ^ version_mix);
  const uint32_t total = piece.rows * piece.row_elements;
  const unsigned long long op_bits = (unsigned long long)piece.op
                                     << WS_CUDA_CHECK_ELEMENT_BITS;
  for (uint32_t i = lane; i < total; i += kWarp) {
    uint32_t row = 0, column = i;
    if (piece.rows > 1) {
      row = i / piece.row_elements;
      column = i - row * piece.row_elements;
    }
    uint64_t element =
        piece.first + (uint64_t)row * piece.element_pitch + column;
    uint32_t bits = float_bits(ws_hash_mix(key + element));
    char *address = reinterpret_cast<char *>(piece.target) +
                    (uint64_t)row * piece.target_pitch +
                    (uint64_t)column * piece.element_bytes;
    int bad = 0;
    if (piece.element_bytes == 2) {
      uint16_t value = (uint16_t)(bits >> 16);
      uint16_t *slot = reinterpret_cast<uint16_t *>(address);
      if (!check)
        *slot = value;
      else
        bad = *slot != value;
    } else {
      uint32_t *slot = reinterpret_cast<uint32_t *>(address);
      if (!check)
        *slot = bits;
      else
        bad = *slot != bits;
    }
    if (bad) {
      (*mismatches)++;
      unsigned long long at = op_bits | element;
      *first_bad = at < *first_bad ? at : *first_bad;
    }
  }
}

__global__ void __launch_bounds__(WS_CUDA_THREADS)
    synth_kernel(const ws_cuda_synth_piece *__restrict__ pieces,
                 const uint32_t *__restrict__ warp_start, uint32_t warps,
                 uint32_t version, int check, ws_cuda_check_state *state) {
  uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
  unsigned lane = threadIdx.x % kWarp;
  if (warp >= warps)
    return;
  const uint64_t version_mix = ws_hash_version(version);
  unsigned long long mismatches = 0, first_bad = ~0ULL;
  for (uint32_t p = warp_start[warp], end = warp_start[warp + 1]; p < end;
       p++)
    synth_piece(pieces[p], version_mix, check, lane, &mismatches, &first_bad);
  if (check) {
    mismatches = warp_sum(mismatches);
    first_bad = warp_min(first_bad);
    if (lane == 0 && mismatches > 0) {
      atomicAdd(&state->mismatches, mismatches);
      atomicMin(&state->first, first_bad);
    }
  }
}


// ---------------------------------------------------------------------------
// FP8: vLLM's per-tensor quantization (host/fp8.h says what and why). The
// arithmetic is written with the _rn intrinsics so that no compiler option
// fuses or approximates it: scale = amax / 448, inverse = 1 / scale, each
// element fmaxf(-448, fminf(x * inverse, 448)) converted with saturation.

constexpr float kFp8Max = 448.0f;

__device__ __forceinline__ float bfloat16_value(uint32_t bits) {
  return __uint_as_float(bits << 16);
}

__device__ __forceinline__ unsigned char fp8_of(float value, float inverse) {
  float scaled = fmaxf(-kFp8Max, fminf(__fmul_rn(value, inverse), kFp8Max));
  return (unsigned char)__nv_cvt_float_to_fp8(scaled, __NV_SATFINITE,
                                              __NV_E4M3);
}

// Whether a piece's rows go 8 elements at a time: 16-byte loads of bfloat16
// and 8-byte stores of float8 on every row.
__device__ __forceinline__ bool fp8_vector(const ws_cuda_fp8_piece &piece) {
  return ((piece.source | piece.source_pitch) & 15) == 0 &&
         ((piece.target | piece.target_pitch) & 7) == 0 &&
         (piece.columns & 7) == 0;
}

// The largest |x| of one piece, over the lanes of a warp (NaN passed over:
// fmaxf keeps the other operand).
__device__ float piece_amax(const ws_cuda_fp8_piece &piece, unsigned lane) {
  float largest = 0.0f;
  const bool vector = fp8_vector(piece);
  for (uint32_t row = 0; row < piece.rows; row++) {
    const char *source =
        reinterpret_cast<const char *>(piece.source) + row * piece.source_pitch;
    if (vector) {
      const uint4 *values = reinterpret_cast<const uint4 *>(source);
      for (uint32_t i = lane; i < piece.columns / 8; i += kWarp) {
        uint4 value = values[i];
        uint32_t words[4] = {value.x, value.y, value.z, value.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
          largest = fmaxf(largest, fabsf(bfloat16_value(words[k] & 0xffffu)));
          largest = fmaxf(largest, fabsf(bfloat16_value(words[k] >> 16)));
        }
      }
    } else {
      const uint16_t *values = reinterpret_cast<const uint16_t *>(source);
      for (uint32_t i = lane; i < piece.columns; i += kWarp)
        largest = fmaxf(largest, fabsf(bfloat16_value(values[i])));
    }
  }
  return largest;
}

__device__ void piece_quantize(const ws_cuda_fp8_piece &piece, float inverse,
                               unsigned lane) {
  const bool vector = fp8_vector(piece);
  for (uint32_t row = 0; row < piece.rows; row++) {
    const char *source =
        reinterpret_cast<const char *>(piece.source) + row * piece.source_pitch;
    unsigned char *target = reinterpret_cast<unsigned char *>(piece.target) +
                            row * piece.target_pitch;
    if (vector) {
      const uint4 *values = reinterpret_cast<const uint4 *>(source);
      uint2 *out = reinterpret_cast<uint2 *>(target);
      for (uint32_t i = lane; i < piece.columns / 8; i += kWarp) {
        uint4 value = values[i];
        uint32_t words[4] = {value.x, value.y, value.z, value.w};
        uint32_t packed[2] = {0, 0};
#pragma unroll
        for (int k = 0; k < 4; k++) {
          uint32_t low = fp8_of(bfloat16_value(words[k] & 0xffffu), inverse);
          uint32_t high = fp8_of(bfloat16_value(words[k] >> 16), inverse);
          packed[k / 2] |= (low | high << 8) << (16 * (k % 2));
        }
        out[i] = make_uint2(packed[0], packed[1]);
      }
    } else {
      const uint16_t *values = reinterpret_cast<const uint16_t *>(source);
      for (uint32_t i = lane; i < piece.columns; i += kWarp)
        target[i] = fp8_of(bfloat16_value(values[i]), inverse);
    }
  }
}

// Each warp takes pieces warp, warp + W, ...: their amax go to their groups'
// (float32 bits of a non-negative value order as unsigned integers).
__global__ void __launch_bounds__(WS_CUDA_THREADS)
    fp8_amax_kernel(const ws_cuda_fp8_piece *__restrict__ pieces,
                    uint32_t count, uint32_t *amax) {
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
  const uint32_t warps = gridDim.x * (blockDim.x / kWarp);
  const unsigned lane = threadIdx.x % kWarp;
  for (uint32_t p = warp; p < count; p += warps) {
    const ws_cuda_fp8_piece piece = pieces[p];
    float largest = piece_amax(piece, lane);
    for (unsigned offset = kWarp / 2; offset > 0; offset /= 2)
      largest = fmaxf(largest, __shfl_xor_sync(kAll, largest, offset));
    if (lane == 0)
      atomicMax(&amax[piece.group], __float_as_uint(largest));
  }
}

// The threads write the groups' scales, then the warps quantize the pieces
// as in fp8_amax_kernel.
__global__ void __launch_bounds__(WS_CUDA_THREADS)
    fp8_quantize_kernel(const ws_cuda_fp8_piece *__restrict__ pieces,
                        uint32_t count, const uint64_t *__restrict__ scales,
                        const uint32_t *__restrict__ amax, uint32_t groups) {
  const uint32_t thread = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t threads = gridDim.x * blockDim.x;
  for (uint32_t g = thread; g < groups; g += threads)
    *reinterpret_cast<float *>(scales[g]) =
        __fdiv_rn(__uint_as_float(amax[g]), kFp8Max);
  const uint32_t warp = thread / kWarp, warps = threads / kWarp;
  const unsigned lane = threadIdx.x % kWarp;
  for (uint32_t p = warp; p < count; p += warps) {
    const ws_cuda_fp8_piece piece = pieces[p];
    const float scale = __fdiv_rn(__uint_as_float(amax[piece.group]), kFp8Max);
    piece_quantize(piece, __fdiv_rn(1.0f, scale), lane);
  }
}

} // namespace

extern "C" int ws_cuda_kernel_capacity(int device, uint32_t *copy_warps,
                                       uint32_t *synth_warps) {
  int processors = 0, copy_blocks = 0, synth_blocks = 0;
  cudaError_t error = cudaDeviceGetAttribute(
      &processors, cudaDevAttrMultiProcessorCount, device);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, "cudaDeviceGetAttribute",
                           "multiprocessors of device %d", device);
  error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &copy_blocks, copy_kernel, WS_CUDA_THREADS, 0);
  if (error == cudaSuccess)
    error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &synth_blocks, synth_kernel, WS_CUDA_THREADS, 0);
  if (error != cudaSuccess)
    return ws_cuda_failure(error, "cudaOccupancyMaxActiveBlocksPerMultiprocessor",
                           "kernels on device %d", device);
  const uint32_t warps_per_block = WS_CUDA_THREADS / WS_CUDA_WARP;
  *copy_warps = (uint32_t)(processors * (copy_blocks > 0 ? copy_blocks : 1)) *
                warps_per_block;
  *synth_warps =
      (uint32_t)(processors * (synth_blocks > 0 ? synth_blocks : 1)) *
      warps_per_block;
  return WS_OK;
}

static unsigned blocks_for(uint32_t warps) {
  return (unsigned)(((uint64_t)warps * WS_CUDA_WARP + WS_CUDA_THREADS - 1) /
                    WS_CUDA_THREADS);
}

extern "C" int ws_cuda_launch_copy(const ws_cuda_copy_desc *descs,
                                   const uint32_t *warp_start, uint32_t warps,
                                   void *stream) {
  void *arguments[] = {&descs, &warp_start, &warps};
  return (int)cudaLaunchKernel((const void *)copy_kernel,
                               dim3(blocks_for(warps)), dim3(WS_CUDA_THREADS),
                               arguments, 0, (cudaStream_t)stream);
}

extern "C" int ws_cuda_launch_copy_tiles(const ws_cuda_copy_desc *descs,
                                         const void *starts, uint32_t count,
                                         uint64_t tile, uint32_t warps,
                                         void *stream) {
  const uint64_t *start_list = static_cast<const uint64_t *>(starts);
  void *arguments[] = {&descs, &start_list, &count, &tile};
  return (int)cudaLaunchKernel((const void *)tiled_copy_kernel,
                               dim3(blocks_for(warps)), dim3(WS_CUDA_THREADS),
                               arguments, 0, (cudaStream_t)stream);
}

extern "C" int ws_cuda_launch_synth(const ws_cuda_synth_piece *pieces,
                                    const uint32_t *warp_start,
                                    uint32_t warps, uint32_t version,
                                    int check, ws_cuda_check_state *state,
                                    void *stream) {
  void *arguments[] = {&pieces, &warp_start, &warps, &version, &check, &state};
  return (int)cudaLaunchKernel((const void *)synth_kernel,
                               dim3(blocks_for(warps)), dim3(WS_CUDA_THREADS),
                               arguments, 0, (cudaStream_t)stream);
}

extern "C" int ws_cuda_launch_fp8(const ws_cuda_fp8_piece *pieces,
                                  uint32_t count, const uint64_t *scales,
                                  uint32_t *amax, uint32_t groups,
                                  uint32_t warps, void *stream) {
  void *amax_arguments[] = {&pieces, &count, &amax};
  cudaError_t error = cudaLaunchKernel(
      (const void *)fp8_amax_kernel, dim3(blocks_for(warps)),
      dim3(WS_CUDA_THREADS), amax_arguments, 0, (cudaStream_t)stream);
  if (error != cudaSuccess)
    return (int)error;
  const uint32_t *amax_read = amax;
  void *quantize_arguments[] = {&pieces, &count, &scales, &amax_read, &groups};
  return (int)cudaLaunchKernel((const void *)fp8_quantize_kernel,
                               dim3(blocks_for(warps)), dim3(WS_CUDA_THREADS),
                               quantize_arguments, 0, (cudaStream_t)stream);
}
