// The C core's functions as one table of pointers, generated at build time
// (scripts/build/core_api.lua writes core_api.c). libwsync exports only the
// API of wsync.h, so ffi.C cannot find the core there: `wsync._core.api`
// hands Lua this table instead.
#pragma once

/// One pointer per function of host/ffi.h and wsync.h; its layout is the type
/// `ws_core_api` of wsync._core's cdef.
extern const struct ws_core_api ws_core_functions;
