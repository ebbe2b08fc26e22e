#include "copy.h"

#include "status.h"

#include <string.h>

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

int ws_copy_run(void *target, size_t target_size, const void *source,
                size_t source_size, const ws_copy_op *ops, size_t count) {
  ws_clear_error();
  for (size_t i = 0; i < count; i++) {
    const ws_copy_op *op = &ops[i];
    if (!fits(op->target_offset, op->rows, op->width, op->target_pitch,
              target_size))
      return ws_fail(WS_EINVAL,
                     "copy op %zu: target [%llu, +%llu rows x %llu, pitch "
                     "%llu) exceeds %zu bytes",
                     i, (unsigned long long)op->target_offset,
                     (unsigned long long)op->rows,
                     (unsigned long long)op->width,
                     (unsigned long long)op->target_pitch, target_size);
    if (!fits(op->source_offset, op->rows, op->width, op->source_pitch,
              source_size))
      return ws_fail(WS_EINVAL,
                     "copy op %zu: source [%llu, +%llu rows x %llu, pitch "
                     "%llu) exceeds %zu bytes",
                     i, (unsigned long long)op->source_offset,
                     (unsigned long long)op->rows,
                     (unsigned long long)op->width,
                     (unsigned long long)op->source_pitch, source_size);
  }
  for (size_t i = 0; i < count; i++) {
    const ws_copy_op *op = &ops[i];
    char *to = (char *)target + op->target_offset;
    const char *from = (const char *)source + op->source_offset;
    if (op->rows == 1 ||
        (op->target_pitch == op->width && op->source_pitch == op->width)) {
      memcpy(to, from, op->rows * op->width);
      continue;
    }
    for (uint64_t row = 0; row < op->rows; row++)
      memcpy(to + row * op->target_pitch, from + row * op->source_pitch,
             op->width);
  }
  return WS_OK;
}

uint64_t ws_copy_bytes(const ws_copy_op *ops, size_t count) {
  uint64_t bytes = 0;
  for (size_t i = 0; i < count; i++)
    bytes += ops[i].rows * ops[i].width;
  return bytes;
}
