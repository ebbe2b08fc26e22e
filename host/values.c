#include "values.h"

#include "hash.h"
#include "status.h"

#include <string.h>

uint64_t ws_values_seed(const char *name, size_t length) {
  return ws_hash_name(name, length);
}

static uint64_t element_bits(const unsigned char *at, size_t element_size) {
  switch (element_size) {
  case 1:
    return *at;
  case 2: {
    uint16_t bits;
    memcpy(&bits, at, 2);
    return bits;
  }
  case 4: {
    uint32_t bits;
    memcpy(&bits, at, 4);
    return bits;
  }
  default: {
    uint64_t bits;
    memcpy(&bits, at, 8);
    return bits;
  }
  }
}

// The S-bytes an op reads: [*from, *to) (empty when *from >= *to).
static void op_span(const ws_values_op *op, uint64_t *from, uint64_t *to) {
  uint64_t last_end = op->first + (op->rows - 1) * op->pitch + op->width;
  *from = op->lo > op->first ? op->lo : op->first;
  *to = op->hi < last_end ? op->hi : last_end;
}

static int check_op(const ws_values_op *op, size_t index, size_t size,
                    size_t element_size, size_t slot_count) {
  uint64_t e = element_size;
  if (op->slot >= slot_count)
    return ws_fail(WS_EINVAL, "values op %zu: slot %llu of %zu", index,
                   (unsigned long long)op->slot, slot_count);
  if (op->first % e || op->width % e || op->pitch % e || op->lo % e ||
      op->hi % e)
    return ws_fail(WS_EINVAL,
                   "values op %zu: offsets, widths, pitches and bounds must "
                   "be whole %zu-byte elements",
                   index, element_size);
  if (op->rows == 0 || op->width == 0)
    return WS_OK;
  if (op->rows > 1 && op->pitch < op->width)
    return ws_fail(WS_EINVAL, "values op %zu: rows overlap (pitch %llu < "
                              "width %llu)",
                   index, (unsigned long long)op->pitch,
                   (unsigned long long)op->width);
  if (op->rows - 1 > (UINT64_MAX - op->first - op->width) /
                         (op->pitch ? op->pitch : 1))
    return ws_fail(WS_EOVERFLOW, "values op %zu: its rows overflow", index);
  uint64_t from, to;
  op_span(op, &from, &to);
  if (from >= to)
    return WS_OK;
  // The memory bytes read, [bias + from, bias + to), within [0, size).
  int inside;
  if (op->bias < 0) {
    uint64_t below = (uint64_t)(-(op->bias + 1)) + 1; // |bias|, no overflow
    inside = from >= below && to - below <= size;
  } else {
    uint64_t above = (uint64_t)op->bias;
    inside = above <= size && to <= size - above;
  }
  if (!inside)
    return ws_fail(WS_EINVAL,
                   "values op %zu: bytes [%lld, %lld) lie outside the %zu "
                   "bytes of memory",
                   index, (long long)from + (long long)op->bias,
                   (long long)to + (long long)op->bias, size);
  return WS_OK;
}

int ws_values_sum(const void *memory, size_t size, size_t element_size,
                  const ws_values_op *ops, size_t count, uint64_t *sums,
                  size_t slot_count) {
  ws_clear_error();
  if (element_size != 1 && element_size != 2 && element_size != 4 &&
      element_size != 8)
    return ws_fail(WS_EINVAL, "values: element size %zu is not 1, 2, 4 or 8",
                   element_size);
  if ((count > 0 && (ops == NULL || sums == NULL)) ||
      (memory == NULL && size > 0))
    return ws_fail(WS_EINVAL, "values: ops, sums and memory are required");
  for (size_t i = 0; i < count; i++) {
    int status = check_op(&ops[i], i, size, element_size, slot_count);
    if (status != WS_OK)
      return status;
  }
  const unsigned char *bytes = memory;
  for (size_t i = 0; i < count; i++) {
    const ws_values_op *op = &ops[i];
    if (op->rows == 0 || op->width == 0)
      continue;
    uint64_t sum = 0;
    for (uint64_t k = 0; k < op->rows; k++) {
      uint64_t row = op->first + k * op->pitch;
      uint64_t from = row > op->lo ? row : op->lo;
      uint64_t to = row + op->width < op->hi ? row + op->width : op->hi;
      if (from >= to)
        continue;
      uint64_t index = op->index_first + k * op->index_pitch +
                       (from - row) / element_size;
      const unsigned char *at = bytes + (int64_t)from + op->bias;
      for (uint64_t x = from; x < to; x += element_size, index++,
                    at += element_size) {
        uint64_t bits = element_bits(at, element_size);
        sum += ws_hash_mix(op->seed ^ ws_hash_mix(index)) * (2 * bits + 1);
      }
    }
    sums[op->slot] += sum;
  }
  return WS_OK;
}
