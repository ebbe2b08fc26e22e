// `wsync._socket`: peer credentials of unix-socket connections.
#include "lua_util.h"
#include "modules.h"
#include "socket.h"

// _socket.peer(fd) -> uid, pid | nil, message, CODE
static int socket_peer(lua_State *L) {
  int fd = (int)luaL_checkinteger(L, 1);
  unsigned uid = 0;
  int pid = 0;
  int status = ws_socket_peer(fd, &uid, &pid);
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_pushinteger(L, (lua_Integer)uid);
  lua_pushinteger(L, pid);
  return 2;
}

// _socket.own_uid() -> uid
static int socket_own_uid(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)ws_socket_own_uid());
  return 1;
}

int luaopen_wsync_socket(lua_State *L) {
  static const luaL_Reg functions[] = {
      {"peer", socket_peer},
      {"own_uid", socket_own_uid},
      {NULL, NULL},
  };
  return ws_lua_new_module(L, functions);
}
