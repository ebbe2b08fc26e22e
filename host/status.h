// Status names, messages and the per-thread error detail of the C core.
#pragma once

#include "status_defs.h"

/// Returns the stable name of a status ("EINVAL"), or "EUNKNOWN".
const char *ws_status_name(int status);

/// Returns the generic message of a status, or "unknown status".
const char *ws_status_message(int status);

/// Returns the detail of the last failure on this thread: what failed, on what,
/// and the library's own error name where there is one. Empty after success:
/// every core function that returns a status calls ws_clear_error() first.
const char *ws_error_detail(void);

#ifndef WS_FFI
/// Records a failure detail for this thread and returns `status`, so that a
/// core function can `return ws_fail(WS_EINVAL, "...", ...)`.
int ws_fail(int status, const char *format, ...)
    __attribute__((format(printf, 2, 3)));
#endif

/// Clears this thread's failure detail.
void ws_clear_error(void);
