// The 64-bit hashes that wsync's generated values rest on, shared by the
// synthetic values (host/synth.c and their kernel, host/cuda_kernels.cu) and
// the values check (host/values.c): a tensor name's seed and the mix of a
// seed with an index. Not part of ffi.h: each user compiles its own copy.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define WS_HASH_FN __host__ __device__ __forceinline__
#else
#define WS_HASH_FN static inline
#endif

/// FNV-1a over the `length` bytes of `name`: a tensor's seed.
WS_HASH_FN uint64_t ws_hash_name(const char *name, size_t length) {
  uint64_t hash = 1469598103934665603ULL;
  for (size_t i = 0; i < length; i++) {
    hash ^= (unsigned char)name[i];
    hash *= 1099511628211ULL;
  }
  return hash;
}

/// splitmix64's finalizer: a well-mixed 64-bit value per input (a seed
/// combined with an index, a version).
WS_HASH_FN uint64_t ws_hash_mix(uint64_t value) {
  value += 0x9e3779b97f4a7c15ULL;
  value = (value ^ (value >> 30)) * 0xbf58476d1ce4e5b9ULL;
  value = (value ^ (value >> 27)) * 0x94d049bb133111ebULL;
  return value ^ (value >> 31);
}

/// The mix of model version `version` that every synthetic tensor's key at
/// that version starts from (key = ws_hash_mix(seed ^ this)).
WS_HASH_FN uint64_t ws_hash_version(uint32_t version) {
  return ws_hash_mix((uint64_t)version * 0x632be59bd9b4e019ULL);
}
