// The openers of wsync's C Lua modules, which the host preloads.
#pragma once

#include <lua.h>

/// Opens `wsync._core`: version, status names, build features, ffi cdef and
/// the core's function table.
int luaopen_wsync_core(lua_State *L);

/// Opens `wsync._manifest`: streaming SHA-256 manifests.
int luaopen_wsync_manifest(lua_State *L);

/// Opens `wsync._shm`: shared-memory buffers of the host backend.
int luaopen_wsync_shm(lua_State *L);

/// Opens `wsync._device`: device identity and memory per backend.
int luaopen_wsync_device(lua_State *L);

/// Opens `wsync._cuda`: device buffers, IPC mappings, streams, copy plans.
int luaopen_wsync_cuda(lua_State *L);

/// Opens `wsync._nccl`: NCCL communicators among trainer ranks.
int luaopen_wsync_nccl(lua_State *L);

/// Opens `wsync._process`: process-group signals, reaping, /proc checks.
int luaopen_wsync_process(lua_State *L);

/// Opens `wsync._socket`: peer credentials of unix-socket connections.
int luaopen_wsync_socket(lua_State *L);

/// Opens `wsync._host`: the host's own services to its scripts (interrupts,
/// the callback error handler, where scripts come from, os.exit). Needs the
/// Lua state of a host (bindings/embed/l_host.c).
int luaopen_wsync_host(lua_State *L);
