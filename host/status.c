#include "status.h"

#include <stdarg.h>
#include <stdio.h>

static __thread char error_detail[512];

const char *ws_status_name(int status) {
  switch (status) {
#define WS_STATUS_NAME_CASE(name, value, message)                              \
  case value:                                                                  \
    return #name;
    WS_STATUS_TABLE(WS_STATUS_NAME_CASE)
#undef WS_STATUS_NAME_CASE
  }
  return "EUNKNOWN";
}

const char *ws_status_message(int status) {
  switch (status) {
#define WS_STATUS_MESSAGE_CASE(name, value, message)                           \
  case value:                                                                  \
    return message;
    WS_STATUS_TABLE(WS_STATUS_MESSAGE_CASE)
#undef WS_STATUS_MESSAGE_CASE
  }
  return "unknown status";
}

const char *ws_error_detail(void) { return error_detail; }

int ws_fail(int status, const char *format, ...) {
  va_list args;
  va_start(args, format);
  vsnprintf(error_detail, sizeof error_detail, format, args);
  va_end(args);
  return status;
}

void ws_clear_error(void) { error_detail[0] = '\0'; }
