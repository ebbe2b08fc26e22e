#include "bindings.h"

#include "status.h"

#include <stdio.h>

int ws_lua_push_failure(lua_State *L, int status) {
  const char *detail = ws_error_detail();
  lua_pushnil(L);
  lua_pushstring(L, detail[0] != '\0' ? detail : ws_status_message(status));
  lua_pushstring(L, ws_status_name(status));
  return 3;
}

void ws_lua_push_box(lua_State *L, const char *class_name, void *pointer) {
  void **box = lua_newuserdata(L, sizeof *box);
  *box = pointer;
  luaL_getmetatable(L, class_name);
  lua_setmetatable(L, -2);
}

int ws_lua_fill_box(lua_State *L, int status, void *object) {
  if (status != WS_OK) {
    lua_pop(L, 1);
    return ws_lua_push_failure(L, status);
  }
  *(void **)lua_touserdata(L, -1) = object;
  return 1;
}

void **ws_lua_check_slot(lua_State *L, int index, const char *class_name) {
  void **box = luaL_testudata(L, index, class_name);
  if (box == NULL) {
    const char *message = lua_pushfstring(L, "%s expected, got %s", class_name,
                                          luaL_typename(L, index));
    luaL_argerror(L, index, message);
  }
  return box;
}

void *ws_lua_check_box(lua_State *L, int index, const char *class_name) {
  void **box = ws_lua_check_slot(L, index, class_name);
  if (*box == NULL) {
    const char *message = lua_pushfstring(L, "%s is closed", class_name);
    luaL_argerror(L, index, message);
  }
  return *box;
}

void ws_lua_new_class(lua_State *L, const char *class_name,
                      const luaL_Reg *methods, const luaL_Reg *metamethods) {
  luaL_newmetatable(L, class_name); // [meta]
  luaL_register(L, NULL, metamethods);
  lua_newtable(L); // [meta, methods]
  luaL_register(L, NULL, methods);
  lua_setfield(L, -2, "__index");
  lua_pushstring(L, class_name);
  lua_setfield(L, -2, "__name");
  lua_pop(L, 1);
}

struct error_text {
  char *out;
  size_t size;
};

// Runs protected (lua_pcall from ws_lua_error_text): [error value, context].
static int error_text_protected(lua_State *L) {
  struct error_text *context = lua_touserdata(L, 2);
  const char *text = NULL;
  if (luaL_callmeta(L, 1, "__tostring"))
    text = lua_tostring(L, -1); // [value, context, text]
  if (text == NULL)
    text = lua_tostring(L, 1);
  const char *traceback = NULL;
  if (lua_type(L, 1) == LUA_TTABLE) {
    lua_getfield(L, 1, "traceback");
    traceback = lua_tostring(L, -1);
  }
  snprintf(context->out, context->size, "%s%s%s",
           text ? text : "(error without a message)", traceback ? "\n" : "",
           traceback ? traceback : "");
  return 0;
}

void ws_lua_error_text(lua_State *L, int index, char *out, size_t size) {
  index = index < 0 ? lua_gettop(L) + index + 1 : index;
  int top = lua_gettop(L);
  struct error_text context = {out, size};
  // __tostring and field reads run Lua code that may raise; outside a
  // protected call that would end the process (LuaJIT's panic).
  lua_pushcfunction(L, error_text_protected);
  lua_pushvalue(L, index);
  lua_pushlightuserdata(L, &context);
  if (lua_pcall(L, 2, 0, 0) != 0) {
    const char *why = lua_tostring(L, -1);
    snprintf(out, size, "(a %s error value that cannot be shown: %s)",
             luaL_typename(L, index), why ? why : "?");
  }
  lua_settop(L, top);
}
