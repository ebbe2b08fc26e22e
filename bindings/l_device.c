// `wsync._device`: device identity and memory for the host and cuda backends.
#include "lua_util.h"
#include "modules.h"
#include "device.h"

static ws_backend check_backend(lua_State *L, int index) {
  static const char *const names[] = {"host", "cuda", NULL};
  return (ws_backend)luaL_checkoption(L, index, NULL, names);
}

// _device.count(backend) -> n | nil, message, CODE
static int device_count(lua_State *L) {
  int count = 0;
  int status = ws_device_count(check_backend(L, 1), &count);
  return ws_lua_push_integer_result(L, status, count);
}

// _device.query(backend, index) -> {index, uuid, name, total_bytes,
// free_bytes} | nil, message, CODE
static int device_query(lua_State *L) {
  ws_backend backend = check_backend(L, 1);
  int index = (int)luaL_checkinteger(L, 2);
  ws_device_info info;
  int status = ws_device_query(backend, index, &info);
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_createtable(L, 0, 5);
  lua_pushinteger(L, info.index);
  lua_setfield(L, -2, "index");
  lua_pushstring(L, info.uuid);
  lua_setfield(L, -2, "uuid");
  lua_pushstring(L, info.name);
  lua_setfield(L, -2, "name");
  lua_pushnumber(L, (lua_Number)info.total_bytes);
  lua_setfield(L, -2, "total_bytes");
  lua_pushnumber(L, (lua_Number)info.free_bytes);
  lua_setfield(L, -2, "free_bytes");
  return 1;
}

int luaopen_wsync_device(lua_State *L) {
  static const luaL_Reg functions[] = {
      {"count", device_count},
      {"query", device_query},
      {NULL, NULL},
  };
  return ws_lua_new_module(L, functions);
}
