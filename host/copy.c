#include "copy.h"

#include "status.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

// An op that writes at least this many bytes stores them with non-temporal
// (streaming) stores: the data path writes each byte once and does not read it
// back soon, and for copies below glibc's own streaming threshold (about 3/4
// of the last-level cache, hundreds of MiB on large servers) regular stores
// spend half the bandwidth on reading target lines into the cache first.
enum { STREAM_MIN_OP_BYTES = 256 * 1024, STREAM_MIN_WIDTH = 64 };

// With several targets, the source goes out in blocks that stay in the cache
// (well under L2) between the writes to each target.
enum { SHARED_BLOCK_BYTES = 64 * 1024 };

// Streaming copies read four places at once, a 64-byte line from each in
// turn: four independent streams keep more reads in flight than one (20-30%
// faster here, for whole pages and for the rows of a strided slice alike).
enum { STREAMS = 4, STREAM_PAGE_BYTES = 4096 };

// True when an op's last row ends inside a buffer of `size` bytes.
static int fits(uint64_t offset, uint64_t rows, uint64_t width, uint64_t pitch,
                uint64_t size) {
  if (rows == 0 || width == 0)
    return offset <= size;
  if (rows > 1 && pitch < width)
    return 0; // rows would overlap
  uint64_t last = rows - 1;
  if (pitch != 0 && last > (UINT64_MAX - width) / pitch)
    return 0;
  uint64_t span = last * pitch + width;
  return offset <= size && span <= size - offset;
}

static void plain_copy(void *to, const void *from, size_t length) {
  memcpy(to, from, length);
}

#if defined(__SSE2__)
// Streams one 64-byte line from `source` to 16-byte aligned `target`.
static inline void stream_line_sse2(char *target, const char *source) {
  __m128i a = _mm_loadu_si128((const __m128i *)source);
  __m128i b = _mm_loadu_si128((const __m128i *)(source + 16));
  __m128i c = _mm_loadu_si128((const __m128i *)(source + 32));
  __m128i d = _mm_loadu_si128((const __m128i *)(source + 48));
  _mm_stream_si128((__m128i *)target, a);
  _mm_stream_si128((__m128i *)(target + 16), b);
  _mm_stream_si128((__m128i *)(target + 32), c);
  _mm_stream_si128((__m128i *)(target + 48), d);
}

// Streams `lines` lines from each of STREAMS places, a line of each in turn:
// place k is `target + k * target_step` (32-byte aligned) and
// `source + k * source_step`.
typedef void (*stream_streams_fn)(char *target, const char *source,
                                  size_t target_step, size_t source_step,
                                  size_t lines);

static void stream_streams_sse2(char *target, const char *source,
                                size_t target_step, size_t source_step,
                                size_t lines) {
  for (size_t at = 0; at < lines * 64; at += 64)
    for (size_t k = 0; k < STREAMS; k++)
      stream_line_sse2(target + k * target_step + at,
                       source + k * source_step + at);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

// stream_streams_sse2 with 32-byte loads and stores (another ~8% here).
__attribute__((target("avx2"))) static void
stream_streams_avx2(char *target, const char *source, size_t target_step,
                    size_t source_step, size_t lines) {
  for (size_t at = 0; at < lines * 64; at += 64)
    for (size_t k = 0; k < STREAMS; k++) {
      const char *from = source + k * source_step + at;
      char *to = target + k * target_step + at;
      __m256i a = _mm256_loadu_si256((const __m256i *)from);
      __m256i b = _mm256_loadu_si256((const __m256i *)(from + 32));
      _mm256_stream_si256((__m256i *)to, a);
      _mm256_stream_si256((__m256i *)(to + 32), b);
    }
}

static stream_streams_fn stream_streams(void) {
  return __builtin_cpu_supports("avx2") ? stream_streams_avx2
                                        : stream_streams_sse2;
}
#else
static stream_streams_fn stream_streams(void) { return stream_streams_sse2; }
#endif

// Copies with streaming stores: memcpy up to the target's first 32-byte
// boundary, groups of STREAMS pages, single lines, then memcpy for the tail.
static void stream_copy(void *to, const void *from, size_t length) {
  char *target = to;
  const char *source = from;
  size_t head = (size_t)(-(uintptr_t)target & 31);
  if (head > length)
    head = length;
  memcpy(target, source, head);
  size_t done = head;
  const size_t group = STREAMS * STREAM_PAGE_BYTES;
  if (length - done >= group) {
    stream_streams_fn streams = stream_streams();
    for (; done + group <= length; done += group)
      streams(target + done, source + done, STREAM_PAGE_BYTES,
              STREAM_PAGE_BYTES, STREAM_PAGE_BYTES / 64);
  }
  for (; done + 64 <= length; done += 64)
    stream_line_sse2(target + done, source + done);
  memcpy(target + done, source + done, length - done);
}

// Copies the rows of a strided op, STREAMS rows a quarter of the op apart at
// a time. Needs whole lines per row and 32-byte aligned target rows; returns
// 0 (nothing copied) otherwise.
static int stream_rows(char *target, const char *source,
                       const ws_copy_op *op) {
  if (op->rows < STREAMS || op->width % 64 != 0 ||
      ((uintptr_t)target | op->target_pitch) % 32 != 0)
    return 0;
  stream_streams_fn streams = stream_streams();
  uint64_t quarter = op->rows / STREAMS;
  for (uint64_t row = 0; row < quarter; row++)
    streams(target + row * op->target_pitch,
            source + row * op->source_pitch, quarter * op->target_pitch,
            quarter * op->source_pitch, op->width / 64);
  for (uint64_t row = quarter * STREAMS; row < op->rows; row++)
    stream_copy(target + row * op->target_pitch,
                source + row * op->source_pitch, op->width);
  return 1;
}

// Orders the streaming stores before whatever the caller does next (answering
// the request that lets another process read the target).
static void stream_fence(void) { _mm_sfence(); }
#else
static void stream_copy(void *to, const void *from, size_t length) {
  memcpy(to, from, length);
}

static int stream_rows(char *target, const char *source,
                       const ws_copy_op *op) {
  (void)target, (void)source, (void)op;
  return 0;
}

static void stream_fence(void) {}
#endif

// Checks every op against its source and every target; the detail names the
// op, and the target or the source when there are several.
static int check_ops(const size_t *target_sizes, size_t target_count,
                     const size_t *source_sizes, size_t source_count,
                     const ws_copy_op *ops, size_t count) {
  for (size_t i = 0; i < count; i++) {
    const ws_copy_op *op = &ops[i];
    if (op->source >= source_count)
      return ws_fail(WS_EINVAL, "copy op %zu: source %llu of %zu", i,
                     (unsigned long long)op->source, source_count);
    size_t source_size = source_sizes[op->source];
    for (size_t t = 0; t < target_count; t++) {
      if (fits(op->target_offset, op->rows, op->width, op->target_pitch,
               target_sizes[t]))
        continue;
      char label[32] = "target";
      if (target_count > 1)
        snprintf(label, sizeof label, "target %zu", t);
      return ws_fail(WS_EINVAL,
                     "copy op %zu: %s [%llu, +%llu rows x %llu, pitch "
                     "%llu) exceeds %zu bytes",
                     i, label, (unsigned long long)op->target_offset,
                     (unsigned long long)op->rows,
                     (unsigned long long)op->width,
                     (unsigned long long)op->target_pitch, target_sizes[t]);
    }
    if (!fits(op->source_offset, op->rows, op->width, op->source_pitch,
              source_size))
      return ws_fail(WS_EINVAL,
                     "copy op %zu: source%s [%llu, +%llu rows x %llu, pitch "
                     "%llu) exceeds %zu bytes",
                     i, source_count > 1 ? " (of several)" : "",
                     (unsigned long long)op->source_offset,
                     (unsigned long long)op->rows,
                     (unsigned long long)op->width,
                     (unsigned long long)op->source_pitch, source_size);
  }
  return WS_OK;
}

typedef void (*copy_fn)(void *, const void *, size_t);

// Copies `length` source bytes to `offset` in every target. With several
// targets it goes block by block, so that each block is read from memory once
// and written to the other targets from the cache.
static void copy_span(char *const *targets, size_t target_count,
                      uint64_t offset, const char *from, uint64_t length,
                      copy_fn copy) {
  if (target_count == 1) {
    copy(targets[0] + offset, from, length);
    return;
  }
  for (uint64_t done = 0; done < length; done += SHARED_BLOCK_BYTES) {
    size_t block = length - done < SHARED_BLOCK_BYTES
                       ? (size_t)(length - done)
                       : (size_t)SHARED_BLOCK_BYTES;
    for (size_t t = 0; t < target_count; t++)
      copy(targets[t] + offset + done, from + done, block);
  }
}

static void run_ops(char *const *targets, size_t target_count,
                    const char *const *sources, const ws_copy_op *ops,
                    size_t count) {
  int streamed = 0;
  for (size_t i = 0; i < count; i++) {
    const ws_copy_op *op = &ops[i];
    if (op->rows == 0 || op->width == 0)
      continue; // nothing to copy (and no row loop over an empty op)
    const char *from = sources[op->source] + op->source_offset;
    copy_fn copy = plain_copy;
    if (op->rows * op->width >= STREAM_MIN_OP_BYTES &&
        op->width >= STREAM_MIN_WIDTH) {
      copy = stream_copy;
      streamed = 1;
    }
    if (op->rows == 1 ||
        (op->target_pitch == op->width && op->source_pitch == op->width)) {
      copy_span(targets, target_count, op->target_offset, from,
                op->rows * op->width, copy);
      continue;
    }
    if (copy == stream_copy && target_count == 1 &&
        stream_rows(targets[0] + op->target_offset, from, op))
      continue;
    for (uint64_t row = 0; row < op->rows; row++)
      copy_span(targets, target_count,
                op->target_offset + row * op->target_pitch,
                from + row * op->source_pitch, op->width, copy);
  }
  if (streamed)
    stream_fence();
}

int ws_copy_run(void *target, size_t target_size, const void *source,
                size_t source_size, const ws_copy_op *ops, size_t count) {
  ws_clear_error();
  int status = check_ops(&target_size, 1, &source_size, 1, ops, count);
  if (status != WS_OK)
    return status;
  char *targets[1] = {target};
  const char *sources[1] = {source};
  run_ops(targets, 1, sources, ops, count);
  return WS_OK;
}

int ws_copy_run_targets(void *const *targets, const size_t *target_sizes,
                        size_t target_count, const void *source,
                        size_t source_size, const ws_copy_op *ops,
                        size_t count) {
  ws_clear_error();
  if (target_count == 0 || target_count > WS_COPY_TARGETS_MAX)
    return ws_fail(WS_EINVAL, "copy: %zu targets (1 to %d)", target_count,
                   WS_COPY_TARGETS_MAX);
  int status =
      check_ops(target_sizes, target_count, &source_size, 1, ops, count);
  if (status != WS_OK)
    return status;
  char *bases[WS_COPY_TARGETS_MAX];
  for (size_t t = 0; t < target_count; t++)
    bases[t] = targets[t];
  const char *sources[1] = {source};
  run_ops(bases, target_count, sources, ops, count);
  return WS_OK;
}

int ws_copy_run_sources(void *const *targets, const size_t *target_sizes,
                        size_t target_count, void *const *sources,
                        const size_t *source_sizes, size_t source_count,
                        const ws_copy_op *ops, size_t count) {
  ws_clear_error();
  if (target_count == 0 || target_count > WS_COPY_TARGETS_MAX)
    return ws_fail(WS_EINVAL, "copy: %zu targets (1 to %d)", target_count,
                   WS_COPY_TARGETS_MAX);
  if (source_count > WS_COPY_SOURCES_MAX)
    return ws_fail(WS_EINVAL, "copy: %zu sources (at most %d)", source_count,
                   WS_COPY_SOURCES_MAX);
  int status = check_ops(target_sizes, target_count, source_sizes,
                         source_count, ops, count);
  if (status != WS_OK)
    return status;
  char *bases[WS_COPY_TARGETS_MAX];
  for (size_t t = 0; t < target_count; t++)
    bases[t] = targets[t];
  run_ops(bases, target_count, (const char *const *)sources, ops, count);
  return WS_OK;
}

int ws_copy_prefault(void *target, size_t size) {
  ws_clear_error();
  if (size == 0)
    return WS_OK;
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  uintptr_t first = (uintptr_t)target & ~(uintptr_t)(page - 1);
  uintptr_t end = (uintptr_t)target + size;
#ifdef MADV_POPULATE_WRITE
  if (madvise((void *)first, end - first, MADV_POPULATE_WRITE) == 0)
    return WS_OK;
  if (errno != EINVAL)
    return ws_fail(errno == ENOMEM ? WS_ENOMEM : WS_ESYS,
                   "copy: cannot fault in %zu bytes: %s", size,
                   strerror(errno));
#endif
  // A kernel before 5.14: write each page's first byte back to itself.
  for (uintptr_t at = (uintptr_t)target; at < end;
       at = (at & ~(uintptr_t)(page - 1)) + page) {
    volatile char *byte = (volatile char *)at;
    *byte = *byte;
  }
  return WS_OK;
}

uint64_t ws_copy_bytes(const ws_copy_op *ops, size_t count) {
  uint64_t bytes = 0;
  for (size_t i = 0; i < count; i++)
    bytes += ops[i].rows * ops[i].width;
  return bytes;
}
