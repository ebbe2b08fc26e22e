// `wsync._core`: version, status table, build features (the commit, the build
// type, CUDA and NCCL), the ffi cdef and the core's function table.
#define _GNU_SOURCE // dladdr
#include "build_info.h"
#include "core_api.h"
#include "device.h"
#include "lua_util.h"
#include "modules.h"
#include "nccl_comm.h"
#include "scripts.h"
#include "status.h"

#include <dlfcn.h>

// _core.status_name(code) -> "EINVAL"
static int core_status_name(lua_State *L) {
  lua_pushstring(L, ws_status_name((int)luaL_checkinteger(L, 1)));
  return 1;
}

// _core.status_message(code) -> "invalid argument"
static int core_status_message(lua_State *L) {
  lua_pushstring(L, ws_status_message((int)luaL_checkinteger(L, 1)));
  return 1;
}

// Pushes {NAME = code, ...} for every status in the table.
static void push_status_codes(lua_State *L) {
  lua_newtable(L);
#define WS_STATUS_FIELD(name, value, message)                                  \
  lua_pushinteger(L, value);                                                   \
  lua_setfield(L, -2, #name);
  WS_STATUS_TABLE(WS_STATUS_FIELD)
#undef WS_STATUS_FIELD
}

int luaopen_wsync_core(lua_State *L) {
  static const luaL_Reg functions[] = {
      {"status_name", core_status_name},
      {"status_message", core_status_message},
      {NULL, NULL},
  };
  ws_lua_new_module(L, functions); // [module]
  lua_pushstring(L, WSYNC_VERSION);
  lua_setfield(L, -2, "version");
  push_status_codes(L);
  lua_setfield(L, -2, "status");
  lua_pushboolean(L, ws_device_cuda_built());
  lua_setfield(L, -2, "cuda_built");
  lua_pushboolean(L, ws_nccl_built());
  lua_setfield(L, -2, "nccl_built");
  lua_pushstring(L, ws_build_commit);
  lua_setfield(L, -2, "commit");
  lua_pushstring(L, WSYNC_BUILD_TYPE);
  lua_setfield(L, -2, "build_type");
#ifdef WSYNC_CUDA_VERSION
  lua_pushstring(L, WSYNC_CUDA_VERSION); // the toolkit the cuda backend was built with
#else
  lua_pushnil(L);
#endif
  lua_setfield(L, -2, "cuda_version");
  lua_pushstring(L, ws_ffi_cdef);
  lua_setfield(L, -2, "cdef");
  lua_pushlightuserdata(L, (void *)&ws_core_functions);
  lua_setfield(L, -2, "api");
  // The file this code was loaded from: the wsync binary, or libwsync.so in
  // an embedding process (whose own executable is the trainer's).
  Dl_info info;
  if (dladdr((void *)&ws_core_functions, &info) != 0 && info.dli_fname != NULL)
    lua_pushstring(L, info.dli_fname);
  else
    lua_pushnil(L);
  lua_setfield(L, -2, "image");
  return 1;
}
