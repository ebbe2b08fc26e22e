// Helpers that every Lua binding shares (lua_util.h).
#include "lua_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The registry key of the exit sentinel's metatable.
static const char exit_metatable_key = 'x';

// Pushes the exit sentinel's metatable, creating it on first use.
static void push_exit_metatable(lua_State *L) {
  lua_pushlightuserdata(L, (void *)&exit_metatable_key);
  lua_rawget(L, LUA_REGISTRYINDEX);
  if (!lua_isnil(L, -1))
    return;
  lua_pop(L, 1);
  lua_createtable(L, 0, 1);
  lua_pushliteral(L, "wsync exit");
  lua_setfield(L, -2, "__name");
  lua_pushlightuserdata(L, (void *)&exit_metatable_key);
  lua_pushvalue(L, -2);
  lua_rawset(L, LUA_REGISTRYINDEX); // [meta]
}

// Whether the value at `index` is the exit sentinel. Raises nothing.
static int is_exit(lua_State *L, int index) {
  if (lua_type(L, index) != LUA_TTABLE || !lua_getmetatable(L, index))
    return 0;
  lua_pushlightuserdata(L, (void *)&exit_metatable_key);
  lua_rawget(L, LUA_REGISTRYINDEX);
  int same = lua_rawequal(L, -1, -2);
  lua_pop(L, 2);
  return same;
}

int ws_lua_raise_exit(lua_State *L, int code) {
  lua_createtable(L, 0, 1);
  lua_pushinteger(L, code);
  lua_setfield(L, -2, "code");
  push_exit_metatable(L);
  lua_setmetatable(L, -2);
  return lua_error(L);
}

int ws_lua_exit_code(lua_State *L, int index, int *code) {
  index = index < 0 ? lua_gettop(L) + index + 1 : index;
  if (!is_exit(L, index))
    return 0;
  lua_getfield(L, index, "code");
  *code = (int)lua_tointeger(L, -1);
  lua_pop(L, 1);
  return 1;
}

// Strings get a traceback; error objects (tables) keep their identity and
// gain a `traceback` field; the exit sentinel raised by os.exit passes
// untouched.
int ws_lua_message_handler(lua_State *L) {
  if (lua_type(L, 1) == LUA_TTABLE) {
    if (is_exit(L, 1))
      return 1;
    lua_getfield(L, 1, "traceback");
    int has_traceback = !lua_isnil(L, -1);
    lua_pop(L, 1);
    if (!has_traceback) {
      luaL_traceback(L, L, NULL, 1);
      lua_setfield(L, 1, "traceback");
    }
    return 1;
  }
  const char *message = lua_tostring(L, 1);
  if (message == NULL) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING)
      message = lua_tostring(L, -1);
    else
      message = lua_pushfstring(L, "(error object is a %s value)",
                                luaL_typename(L, 1));
  }
  luaL_traceback(L, L, message, 1);
  return 1;
}

int ws_lua_push_failure(lua_State *L, int status) {
  const char *detail = ws_error_detail();
  lua_pushnil(L);
  lua_pushstring(L, detail[0] != '\0' ? detail : ws_status_message(status));
  lua_pushstring(L, ws_status_name(status));
  return 3;
}

int ws_lua_push_ok(lua_State *L, int status) {
  return ws_lua_push_boolean_result(L, status, 1);
}

int ws_lua_push_boolean_result(lua_State *L, int status, int value) {
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_pushboolean(L, value);
  return 1;
}

int ws_lua_push_integer_result(lua_State *L, int status, lua_Integer value) {
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_pushinteger(L, value);
  return 1;
}

void ws_lua_set_number(lua_State *L, const char *key, uint64_t value) {
  lua_pushnumber(L, (lua_Number)value);
  lua_setfield(L, -2, key);
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

void *ws_lua_take_box(lua_State *L, int index, const char *class_name) {
  void **box = ws_lua_check_slot(L, index, class_name);
  void *object = *box;
  *box = NULL;
  return object;
}

const ws_lua_class *ws_lua_class_of(lua_State *L) {
  return lua_touserdata(L, lua_upvalueindex(1));
}

// box:close() (or the class's name for it) -> true | nil, message, CODE
static int release_box(lua_State *L) {
  const ws_lua_class *info = ws_lua_class_of(L);
  return ws_lua_push_ok(L, info->release(ws_lua_take_box(L, 1, info->name)));
}

// __gc: releases what close() did not; raises nothing, and does nothing for
// a closed box (not even clear the thread's error detail).
static int collect_box(lua_State *L) {
  const ws_lua_class *info = ws_lua_class_of(L);
  void **box = lua_touserdata(L, 1);
  void *object = *box;
  *box = NULL;
  if (object != NULL && info->collect != NULL)
    info->collect(object);
  else if (object != NULL)
    info->release(object);
  return 0;
}

// __tostring: "NAME DESCRIPTION", "NAME" or "NAME (closed)"
static int describe_box(lua_State *L) {
  const ws_lua_class *info = ws_lua_class_of(L);
  void **box = ws_lua_check_slot(L, 1, info->name);
  if (*box == NULL) {
    lua_pushfstring(L, "%s (closed)", info->name);
    return 1;
  }
  lua_pushstring(L, info->name);
  if (info->describe != NULL) {
    lua_pushliteral(L, " ");
    info->describe(L, *box); // [name, " ", description]
    lua_concat(L, 3);
  }
  return 1;
}

// Sets field `name` of the table on top to `function` with `info` as its
// upvalue.
static void set_class_function(lua_State *L, const ws_lua_class *info,
                               const char *name, lua_CFunction function) {
  lua_pushlightuserdata(L, (void *)info);
  lua_pushcclosure(L, function, 1);
  lua_setfield(L, -2, name);
}

int ws_lua_new_module(lua_State *L, const luaL_Reg *functions) {
  lua_newtable(L);
  luaL_register(L, NULL, functions);
  return 1;
}

void ws_lua_new_class(lua_State *L, const ws_lua_class *info,
                      const luaL_Reg *methods) {
  luaL_newmetatable(L, info->name); // [meta]
  set_class_function(L, info, "__gc", collect_box);
  set_class_function(L, info, "__tostring", describe_box);
  lua_newtable(L); // [meta, methods]
  if (info->release_method != NULL)
    set_class_function(L, info, info->release_method, release_box);
  lua_setfield(L, -2, "__index");
  lua_pushstring(L, info->name);
  lua_setfield(L, -2, "__name");
  lua_pop(L, 1);
  ws_lua_add_methods(L, info, methods);
}

void ws_lua_add_methods(lua_State *L, const ws_lua_class *info,
                        const luaL_Reg *methods) {
  luaL_getmetatable(L, info->name); // [meta]
  lua_getfield(L, -1, "__index");   // [meta, methods]
  lua_pushlightuserdata(L, (void *)info); // [meta, methods, class]
  luaL_openlib(L, NULL, methods, 1);      // [meta, methods]
  lua_pop(L, 2);
}

struct error_text {
  char *out;
  size_t size;
  char *code; // NULL: ws_lua_error_text's form
  size_t code_size;
};

// The string field `key` of the table at `index`, or NULL.
static const char *string_field(lua_State *L, int index, const char *key) {
  lua_getfield(L, index, key);
  return lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
}

// Runs protected (lua_pcall from ws_lua_error_text): [error value, context].
static int error_text_protected(lua_State *L) {
  struct error_text *context = lua_touserdata(L, 2);
  const char *text = NULL;
  if (luaL_callmeta(L, 1, "__tostring"))
    text = lua_tostring(L, -1); // [value, context, text]
  if (text == NULL)
    text = lua_tostring(L, 1);
  const char *traceback = NULL;
  const char *code = NULL;
  const char *cause = NULL;
  if (lua_type(L, 1) == LUA_TTABLE) {
    traceback = string_field(L, 1, "traceback");
    if (context->code != NULL) {
      code = string_field(L, 1, "code");
      cause = string_field(L, 1, "cause");
    }
  }
  if (code == NULL) {
    snprintf(context->out, context->size, "%s%s%s",
             text ? text : "(error without a message)", traceback ? "\n" : "",
             traceback ? traceback : "");
    return 0;
  }
  const char *verbose = getenv("WSYNC_TRACEBACK");
  if (strcmp(code, "LUA_ERROR") != 0 &&
      !(verbose != NULL && strcmp(verbose, "1") == 0))
    traceback = NULL;
  int other_cause = cause != NULL && strcmp(cause, code) != 0;
  snprintf(context->out, context->size, "%s (%s%s%s)%s%s",
           text ? text : "(error without a message)", code,
           other_cause ? ", cause " : "", other_cause ? cause : "",
           traceback ? "\n" : "", traceback ? traceback : "");
  snprintf(context->code, context->code_size, "%s", code);
  return 0;
}

void ws_lua_error_text(lua_State *L, int index, char *out, size_t size) {
  ws_lua_error_coded(L, index, out, size, NULL, 0);
}

void ws_lua_error_coded(lua_State *L, int index, char *out, size_t size,
                        char *code, size_t code_size) {
  if (code != NULL && code_size > 0)
    code[0] = '\0';
  index = index < 0 ? lua_gettop(L) + index + 1 : index;
  int top = lua_gettop(L);
  struct error_text context = {out, size, code_size > 0 ? code : NULL,
                               code_size};
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
