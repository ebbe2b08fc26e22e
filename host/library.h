// Shared libraries that wsync opens with dlopen on first use instead of
// linking them (NCCL, NVML), so that it starts on a machine without them: the
// path from an environment variable or a default, the functions it needs
// (some optional), what the library's first call must do, and a readable
// reason when any of it fails, kept for every later call.
#pragma once

#include <pthread.h>
#include <stddef.h>

/// A function a library must (or may) have, and where its address goes.
typedef struct ws_library_symbol {
  const char *name;
  void **slot;
  int required;
} ws_library_symbol;

/// A library opened once per process. `variable` names its path when set and
/// not empty, `default_path` otherwise; `prefix` ("nccl") begins a failure's
/// detail, `purpose` says in it what the library is for, and `needs` (NULL:
/// nothing) follows a missing function's name. Defined static, with `lock`
/// PTHREAD_MUTEX_INITIALIZER and the rest of the state zero.
typedef struct ws_library {
  const char *prefix;
  const char *variable;
  const char *default_path;
  const char *purpose;
  const char *needs;
  ws_library_symbol *symbols;
  size_t count;
  /// Starts the library once its functions are found (NULL: nothing to do):
  /// returns a status, with the reason in `detail` (`size` bytes) when it
  /// fails. `path` is what was opened.
  int (*start)(const char *path, char *detail, size_t size);
  pthread_mutex_t lock;
  int tried;
  int status;
  char detail[512];
} ws_library;

/// Opens `library` on the first call: stores each function's address in its
/// slot (NULL for a missing optional one), then starts it. Returns WS_OK, or
/// the failure (WS_ENODEV: "PREFIX: cannot load PATH (PURPOSE): REASON",
/// "PREFIX: PATH has no FUNCTION (NEEDS)"; or what `start` said) with its
/// detail recorded, then and on every later call. When it fails, every slot
/// is NULL and the library is closed again.
int ws_library_load(ws_library *library);
