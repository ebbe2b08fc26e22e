// `wsync._host`: the embedding host's own services to its scripts: Ctrl-C for
// REPL chunks, the handler of errors in libuv callbacks, where the scripts
// come from, os.exit and the process id.
#include "host_internal.h"
#include "interrupt.h"
#include "lua_util.h"
#include "modules.h"
#include "script_loader.h"

#include <lauxlib.h>

#include <unistd.h>

// _host.arm_interrupt(): from now until disarm_interrupt(), SIGINT raises the
// Lua error "interrupted" in whatever Lua code runs (the REPL arms it around
// each chunk; loops it compiles run interpreted so that the hook is seen).
static int host_arm_interrupt(lua_State *L) {
  ws_host *host = ws_host_from_state(L);
  ws_interrupt_arm(ws_host_lua_state(host), host);
  return 0;
}

// _host.disarm_interrupt(): undoes this host's arm_interrupt (another host's
// arm is left alone).
static int host_disarm_interrupt(lua_State *L) {
  ws_interrupt_disarm(ws_host_from_state(L));
  return 0;
}

// _host.set_callback_error_handler(fn | nil)
static int host_set_callback_error_handler(lua_State *L) {
  if (!lua_isnoneornil(L, 1))
    luaL_checktype(L, 1, LUA_TFUNCTION);
  lua_settop(L, 1);
  ws_host_set_callback_error_handler(L, 1);
  return 0;
}

// _host.script_root() -> path | nil (nil: embedded bytecode)
static int host_script_root(lua_State *L) {
  const char *root = ws_host_script_root(ws_host_from_state(L));
  if (root[0] == '\0')
    lua_pushnil(L);
  else
    lua_pushstring(L, root);
  return 1;
}

// _host.embedded_modules() -> {name, ...}
static int host_embedded_modules(lua_State *L) {
  ws_scripts_push_embedded_names(L);
  return 1;
}

// _host.exit([code]) raises the exit sentinel; the top level turns it into the
// process exit code after an orderly shutdown. Installed as os.exit.
static int host_exit(lua_State *L) {
  int code = 0;
  if (lua_isboolean(L, 1))
    code = lua_toboolean(L, 1) ? 0 : 1;
  else
    code = (int)luaL_optinteger(L, 1, 0);
  return ws_lua_raise_exit(L, code);
}

// _host.pid() -> this process's id
static int host_pid(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)getpid());
  return 1;
}

int luaopen_wsync_host(lua_State *L) {
  static const luaL_Reg functions[] = {
      {"arm_interrupt", host_arm_interrupt},
      {"disarm_interrupt", host_disarm_interrupt},
      {"set_callback_error_handler", host_set_callback_error_handler},
      {"script_root", host_script_root},
      {"embedded_modules", host_embedded_modules},
      {"exit", host_exit},
      {"pid", host_pid},
      {"message_handler", ws_lua_message_handler},
      {NULL, NULL},
  };
  return ws_lua_new_module(L, functions);
}
