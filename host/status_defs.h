// Status codes shared by every part of the C core.
//
// One X-macro table gives each code its number, its name and its message. The
// enum is generated from it, and so are the name and message lookups in
// status.c. Numbers are stable: they travel in error objects and exit paths.
#pragma once

#define WS_STATUS_TABLE(X)                                                     \
  X(OK, 0, "success")                                                          \
  X(EINVAL, -1, "invalid argument")                                            \
  X(ENOMEM, -2, "out of memory")                                               \
  X(ESYS, -3, "operating system call failed")                                  \
  X(ECRYPTO, -4, "cryptographic library failed")                               \
  X(ECLOSED, -5, "object is closed")                                           \
  X(EOVERFLOW, -6, "size overflows")                                           \
  X(ENOTFOUND, -7, "not found")                                                \
  X(EEXIST, -8, "already exists")                                              \
  X(ENODEV, -9, "device backend not available")                                \
  X(ECUDA, -10, "CUDA call failed")                                            \
  X(ENCCL, -11, "NCCL call failed")                                            \
  X(ESTATE, -12, "operation not allowed in the current state")                 \
  X(ELUA, -13, "Lua error")                                                    \
  X(EFAILED, -14, "operation failed (see the error text)")

#define WS_STATUS_ENUM_ITEM(name, value, message) WS_##name = value,

/// Status returned by core functions: 0 for success, a negative code otherwise.
typedef enum ws_status { WS_STATUS_TABLE(WS_STATUS_ENUM_ITEM) } ws_status;

#undef WS_STATUS_ENUM_ITEM
