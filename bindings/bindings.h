// Shared helpers for the Lua bindings and their module entry points.
#pragma once

#include <lauxlib.h>
#include <lua.h>
#include <stddef.h>
#include <stdint.h>

#include "wsync.h"

/// Opens `wsync._core`: version, status names, build features, ffi cdef.
int luaopen_wsync_core(lua_State *L);

/// Opens `wsync._manifest`: streaming SHA-256 manifests.
int luaopen_wsync_manifest(lua_State *L);

/// Opens `wsync._shm`: shared-memory buffers of the host backend.
int luaopen_wsync_shm(lua_State *L);

/// Opens `wsync._device`: device identity and memory per backend.
int luaopen_wsync_device(lua_State *L);

/// Opens `wsync._process`: process-group signals, reaping, /proc checks.
int luaopen_wsync_process(lua_State *L);

/// Opens `wsync._socket`: peer credentials of unix-socket connections.
int luaopen_wsync_socket(lua_State *L);

/// Message handler for protected calls: adds a traceback to string errors and
/// a `traceback` field to error objects.
int ws_lua_message_handler(lua_State *L);

/// Writes the error value at `index` as text into `out`: an error object's
/// __tostring (or the string itself), then its traceback when it has one.
void ws_lua_error_text(lua_State *L, int index, char *out, size_t size);

/// Returns the Lua state of an embedding host (the agent API runs in it).
lua_State *ws_host_lua_state(ws_host *host);

/// The head of the host's list of open agents (agent.c links them): closing
/// the host detaches them, so that a later ws_agent_* call fails cleanly.
ws_agent **ws_host_agents(ws_host *host);

/// Marks every agent in the list as belonging to a closed host.
void ws_agents_detach(ws_agent *agents);

/// Step callbacks (C code called from the loop) running on this thread: no
/// wsync call may nest in one.
extern _Thread_local int ws_callback_depth;

/// Replaces the host's last error text (ws_host_error) with `text`.
void ws_host_set_error(ws_host *host, const char *text);

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
