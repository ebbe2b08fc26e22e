// Helpers that every Lua binding shares: protected-call error values, the
// exit sentinel, `nil, message, CODE` failures and boxed-pointer userdata.
// Nothing here knows of a host.
#pragma once

#include <lauxlib.h>
#include <lua.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

/// Message handler for protected calls: adds a traceback to string errors and
/// a `traceback` field to error objects; passes the exit sentinel untouched.
int ws_lua_message_handler(lua_State *L);

/// Writes the error value at `index` as text into `out`: an error object's
/// __tostring (or the string itself), then its traceback when it has one.
void ws_lua_error_text(lua_State *L, int index, char *out, size_t size);

/// As ws_lua_error_text, for an error that leaves wsync through its C API: a
/// wsync error object (a table with a string `code`) is written as its
/// __tostring then " (CODE)" (" (CODE, cause C)" when it names another cause),
/// as the agent API writes its failures, with its traceback only when the code
/// is LUA_ERROR (a bug) or $WSYNC_TRACEBACK is 1; the code goes into `code`
/// (`code_size` bytes). Any other value is written as ws_lua_error_text writes
/// it, and `code` is left empty.
void ws_lua_error_coded(lua_State *L, int index, char *out, size_t size,
                        char *code, size_t code_size);

/// Raises the exit sentinel (what os.exit raises inside wsync): a table with
/// `code` whose metatable is named "wsync exit". Does not return.
int ws_lua_raise_exit(lua_State *L, int code);

/// Returns 1 and stores its code in `*code` when the value at `index` is the
/// exit sentinel; returns 0 and leaves `*code` alone otherwise.
int ws_lua_exit_code(lua_State *L, int index, int *code);

/// Pushes `nil, message, CODE` for a failed core call and returns 3, the
/// binding's return count. The message is the core's detail or the generic
/// message of the status.
int ws_lua_push_failure(lua_State *L, int status);

/// Pushes `true` and returns 1 when `status` is WS_OK; pushes `nil, message,
/// CODE` and returns 3 otherwise (ws_lua_push_failure).
int ws_lua_push_ok(lua_State *L, int status);

/// Pushes a core call's boolean result `value` and returns 1 when `status` is
/// WS_OK; pushes `nil, message, CODE` and returns 3 otherwise.
int ws_lua_push_boolean_result(lua_State *L, int status, int value);

/// The same for an integer result.
int ws_lua_push_integer_result(lua_State *L, int status, lua_Integer value);

/// Sets field `key` of the table on top to `value` (a count, a size or an
/// address the core keeps as uint64_t) as a number: exact below 2^53.
void ws_lua_set_number(lua_State *L, const char *key, uint64_t value);

/// Creates a boxed-pointer userdata holding `pointer` with the named metatable
/// (created by ws_lua_new_class) and leaves it on the stack.
void ws_lua_push_box(lua_State *L, const char *class_name, void *pointer);

/// Stores `object`, created after its empty box was pushed (so that a box
/// that cannot be allocated leaks nothing), in the box on top of the stack
/// and returns 1; when `status` is a failure, pops the box and pushes nil,
/// message, CODE instead (returns 3).
int ws_lua_fill_box(lua_State *L, int status, void *object);

/// Returns the pointer in the box at `index`; raises an argument error naming
/// the expected class when the value is something else or is closed.
void *ws_lua_check_box(lua_State *L, int index, const char *class_name);

/// Returns the box slot at `index` (raising when it is the wrong class) so
/// that close() can read and NULL it; the slot may hold NULL.
void **ws_lua_check_slot(lua_State *L, int index, const char *class_name);

/// Empties the box at `index` (raising when it is the wrong class) and returns
/// the object it held, NULL when it was closed already: what close() frees.
void *ws_lua_take_box(lua_State *L, int index, const char *class_name);

/// A boxed-pointer class: how its object is released and shown. Every class
/// gets its release method, `__gc` and `__tostring` from this description.
typedef struct ws_lua_class {
  const char *name; // the metatable's name, "wsync.shm"
  /// The method that releases the object and pushes true or nil, message,
  /// CODE: "close", "destroy" (NULL: the class registers its own).
  const char *release_method;
  /// Releases an object (NULL accepted) and returns a status.
  int (*release)(void *object);
  /// The finalizer's release when it must differ from `release` (it may not
  /// block); NULL: `release`.
  int (*collect)(void *object);
  /// Pushes what `__tostring` shows of an open object after the class name;
  /// NULL: the name alone.
  void (*describe)(lua_State *L, void *object);
} ws_lua_class;

/// Pushes a new module table holding `functions` and returns 1, what the
/// module's luaopen function returns.
int ws_lua_new_module(lua_State *L, const luaL_Reg *functions);

/// Creates the metatable of `info` (which outlives the state: static) with
/// `methods` (each with the class as its upvalue: ws_lua_class_of) and the
/// release method as __index, `__gc` (the safety net: a
/// no-op after the release) and `__tostring` ("NAME DESCRIPTION" or "NAME
/// (closed)"); leaves nothing on the stack.
void ws_lua_new_class(lua_State *L, const ws_lua_class *info,
                      const luaL_Reg *methods);

/// Adds `methods` (each with the class as its upvalue) to the class of
/// `info`, made by ws_lua_new_class: for methods that several classes share,
/// listed once; leaves nothing on the stack.
void ws_lua_add_methods(lua_State *L, const ws_lua_class *info,
                        const luaL_Reg *methods);

/// The class of the running method, release method, `__gc` or `__tostring`
/// of a class made by ws_lua_new_class (their upvalue), so that one function
/// serves several classes; the `describe` and `release` functions those call
/// may ask too.
const ws_lua_class *ws_lua_class_of(lua_State *L);
