// Tensor element types: their checkpoint names and element sizes.
#pragma once

#ifndef WS_FFI
#include <stddef.h>
#endif

#define WS_DTYPE_TABLE(X)                                                      \
  X(BFLOAT16, "bfloat16", 2)                                                   \
  X(FLOAT16, "float16", 2)                                                     \
  X(FLOAT32, "float32", 4)                                                     \
  X(FLOAT64, "float64", 8)                                                     \
  X(FLOAT8_E4M3FN, "float8_e4m3fn", 1)                                         \
  X(FLOAT8_E5M2, "float8_e5m2", 1)                                             \
  X(INT8, "int8", 1)                                                           \
  X(UINT8, "uint8", 1)                                                         \
  X(INT16, "int16", 2)                                                         \
  X(INT32, "int32", 4)                                                         \
  X(INT64, "int64", 8)                                                         \
  X(BOOL, "bool", 1)

#define WS_DTYPE_ENUM_ITEM(name, text, size) WS_DTYPE_##name,

/// Element type of a tensor; WS_DTYPE_COUNT marks the end of the table.
typedef enum ws_dtype {
  WS_DTYPE_TABLE(WS_DTYPE_ENUM_ITEM) WS_DTYPE_COUNT
} ws_dtype;

#undef WS_DTYPE_ENUM_ITEM

/// Looks up a dtype by its torch-style name ("bfloat16"); returns WS_DTYPE_COUNT
/// when the name is unknown.
ws_dtype ws_dtype_from_name(const char *name, size_t length);

/// Returns the torch-style name of a dtype, or NULL when it is out of range.
const char *ws_dtype_name(ws_dtype dtype);

/// Returns the size in bytes of one element, or 0 when it is out of range.
size_t ws_dtype_size(ws_dtype dtype);
