#include "dtype.h"

#include <string.h>

static const struct {
  const char *name;
  size_t size;
} dtypes[WS_DTYPE_COUNT] = {
#define WS_DTYPE_ROW(name, text, size) {text, size},
    WS_DTYPE_TABLE(WS_DTYPE_ROW)
#undef WS_DTYPE_ROW
};

ws_dtype ws_dtype_from_name(const char *name, size_t length) {
  for (int i = 0; i < WS_DTYPE_COUNT; i++) {
    if (strlen(dtypes[i].name) == length &&
        memcmp(dtypes[i].name, name, length) == 0)
      return (ws_dtype)i;
  }
  return WS_DTYPE_COUNT;
}

const char *ws_dtype_name(ws_dtype dtype) {
  return (unsigned)dtype < WS_DTYPE_COUNT ? dtypes[dtype].name : NULL;
}

size_t ws_dtype_size(ws_dtype dtype) {
  return (unsigned)dtype < WS_DTYPE_COUNT ? dtypes[dtype].size : 0;
}
