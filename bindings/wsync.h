// wsync embedding API: open a host, run Lua chunks, files and recipes, close.
//
// A host owns one LuaJIT state with the wsync modules and one libuv loop. It is
// not thread-safe: use a host from the thread that opened it. This header has no
// includes and no macros beyond its guard, so LuaJIT's ffi.cdef reads it after
// the preprocessor lines are dropped.
#pragma once

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ws_host ws_host;

/// Opens a host: a Lua state with the wsync modules and a libuv loop. Stores it
/// in `*out` and returns 0, or returns a negative status.
int ws_host_open(ws_host **out);

/// Runs a Lua chunk, then the loop until no work is left. Returns 0, or a
/// negative status with the message and traceback in ws_host_error().
int ws_host_run_string(ws_host *host, const char *code, const char *chunk_name);

/// Runs a Lua file with `argc` arguments in `arg`, then the loop.
int ws_host_run_file(ws_host *host, const char *path, int argc,
                     const char *const *argv);

/// Runs a recipe file (`wsync run`), with `key=value` overrides.
int ws_host_run_recipe(ws_host *host, const char *path, int argc,
                       const char *const *argv);

/// Runs the command line (`wsync ARGS...`) and returns the process exit code.
int ws_host_main(ws_host *host, int argc, const char *const *argv);

/// Returns the last error message of this host, or an empty string.
const char *ws_host_error(const ws_host *host);

/// Returns the wsync version string.
const char *ws_version(void);

/// Stops new work, closes every handle and the loop, closes the Lua state and
/// frees the host. NULL is accepted.
void ws_host_close(ws_host *host);

#ifdef __cplusplus
}
#endif
