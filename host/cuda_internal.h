// What the cuda backend's files share and nothing else sees (not in ffi.h;
// hidden from libwsync's exports): error formatting, the device switch, region
// checks, counters, and the kernels' launchers (host/cuda_kernels.cu).
#pragma once

#include "cuda_memory.h"
#include "cuda_plan.h"

#include <stddef.h>
#include <stdint.h>

#define WS_INTERNAL __attribute__((visibility("hidden")))

#ifdef __cplusplus
extern "C" {
#endif

enum { WS_CUDA_THREADS = 256, WS_CUDA_WARP = 32 };

/// What a synthetic piece (at most WS_CUDA_PIECE_MAX bytes) writes: `rows`
/// rows of `row_elements` elements of `element_bytes` (2 or 4) each.
typedef struct ws_cuda_synth_piece {
  uint64_t target;
  uint64_t seed;
  uint64_t first;         // tensor element of row 0, column 0
  uint64_t target_pitch;  // bytes
  uint64_t element_pitch; // tensor elements between rows
  uint32_t rows;
  uint32_t row_elements;
  uint32_t op;
  uint32_t element_bytes;
} ws_cuda_synth_piece;

/// The device side of a check: mismatches, and (op << 40 | element) of the
/// first one (UINT64_MAX when none).
typedef struct ws_cuda_check_state {
  unsigned long long mismatches;
  unsigned long long first;
} ws_cuda_check_state;

enum { WS_CUDA_CHECK_ELEMENT_BITS = 40 };

#ifdef WSYNC_WITH_CUDA
/// Records a CUDA failure: "cuda: CONTEXT: CALL: cudaErrorName (text)", with
/// WS_ENODEV for a missing driver or device, WS_ENOMEM for an allocation,
/// WS_ECUDA otherwise. `error` is a cudaError_t.
WS_INTERNAL int ws_cuda_failure(int error, const char *call,
                                const char *format, ...)
    __attribute__((format(printf, 3, 4)));

/// Checks `device` (a driver, a device of that index) and makes it current,
/// storing the caller's device in `*previous` for ws_cuda_leave.
WS_INTERNAL int ws_cuda_enter(int device, int *previous);

/// Makes `previous` the current device again.
WS_INTERNAL void ws_cuda_leave(int previous);

/// Checks that a region is device memory of `device` inside one allocation;
/// the detail names `role` and `index`.
WS_INTERNAL int ws_cuda_check_region(const ws_cuda_region *region, int device,
                                     const char *role, size_t index);

/// Returns the stream's cudaStream_t (NULL: the legacy default stream) after
/// checking that it belongs to `device`.
WS_INTERNAL int ws_cuda_stream_for(ws_cuda_stream *stream, int device,
                                   void **raw);

/// Resolves `stream` for work on `device` (ws_cuda_stream_for, into `*raw`),
/// then makes `device` current (ws_cuda_enter, the caller's device in
/// `*previous` for ws_cuda_leave); leaves nothing entered when it fails.
WS_INTERNAL int ws_cuda_enter_stream(ws_cuda_stream *stream, int device,
                                     void **raw, int *previous);

/// Waits for the work queued on `stream` (a cudaStream_t, NULL: legacy
/// default) so far with an event that blocks in the driver: `event` (a
/// cudaEvent_t with cudaEventBlockingSync) when the caller has one, a
/// temporary one otherwise.
WS_INTERNAL int ws_cuda_wait(void *stream, void *event, const char *what);

/// cudaMalloc / cudaFree with the counters kept.
WS_INTERNAL int ws_cuda_allocate(size_t size, void **out, const char *what);
WS_INTERNAL int ws_cuda_release(void *pointer, size_t size, const char *what);

/// Counts one kernel launch.
WS_INTERNAL void ws_cuda_count_launch(void);

/// Stores how many warps of each kernel `device` runs at once.
WS_INTERNAL int ws_cuda_kernel_capacity(int device, uint32_t *copy_warps,
                                        uint32_t *synth_warps);

/// Launches the copy kernel over `warps` warps (a cudaError_t).
WS_INTERNAL int ws_cuda_launch_copy(const ws_cuda_copy_desc *descs,
                                    const uint32_t *warp_start, uint32_t warps,
                                    void *stream);

/// Launches the tiled copy kernel: `warps` warps take tiles of `tile` bytes
/// of the `count` descriptors' stream in turn (`starts`: count + 1 uint64_t
/// in device memory; host/cuda_tiles.h). A cudaError_t.
WS_INTERNAL int ws_cuda_launch_copy_tiles(const ws_cuda_copy_desc *descs,
                                          const void *starts, uint32_t count,
                                          uint64_t tile, uint32_t warps,
                                          void *stream);

/// Launches the FP8 kernels over `warps` warps: the amax of every group of
/// the `count` pieces into `amax` (float32 bits, zeroed before), then every
/// group's scale (to the addresses `scales`) and every piece's float8
/// elements. A cudaError_t.
WS_INTERNAL int ws_cuda_launch_fp8(const ws_cuda_fp8_piece *pieces,
                                   uint32_t count, const uint64_t *scales,
                                   uint32_t *amax, uint32_t groups,
                                   uint32_t warps, void *stream);

/// Launches the synthetic kernel, filling or (`check`) checking into `state`.
WS_INTERNAL int ws_cuda_launch_synth(const ws_cuda_synth_piece *pieces,
                                     const uint32_t *warp_start,
                                     uint32_t warps, uint32_t version,
                                     int check, ws_cuda_check_state *state,
                                     void *stream);

#endif

#ifdef __cplusplus
}
#endif
