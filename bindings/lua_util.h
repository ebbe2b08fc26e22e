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

/// Creates the metatable `class_name` with `methods` as __index and `__gc`,
/// `__tostring` taken from `metamethods`; leaves nothing on the stack.
void ws_lua_new_class(lua_State *L, const char *class_name,
                      const luaL_Reg *methods, const luaL_Reg *metamethods);
