// What the embedding host (host.c) offers its other parts: the agent API
// (agent.c) and the `wsync._host` module (l_host.c). Not installed; the public
// API is wsync.h. The host knows nothing of agents: an agent holds the host's
// link (host_link.h), which the host clears when it closes.
#pragma once

#include <lua.h>
#include <stddef.h>

#include "host_link.h"
#include "wsync.h"

/// Returns the Lua state of a host (the agent API runs in it).
lua_State *ws_host_lua_state(ws_host *host);

/// Returns the host that owns the Lua state `L` (or a coroutine of it).
ws_host *ws_host_from_state(lua_State *L);

/// Returns the host's link; a holder that outlives a call retains it.
ws_host_link *ws_host_link_of(ws_host *host);

/// Replaces the host's last error text (ws_host_error) with `text`.
void ws_host_set_error(ws_host *host, const char *text);

/// Replaces this thread's ws_last_error text with `text`: why the last open
/// call failed.
void ws_set_last_error(const char *text);

/// Marks the start of a step callback (C code of the trainer that the host's
/// loop calls): until the matching ws_host_leave_callback, every wsync call
/// that would run this host's loop is refused, because the loop is not
/// reentrant.
void ws_host_enter_callback(ws_host *host);

/// Marks the end of the step callback that ws_host_enter_callback began.
void ws_host_leave_callback(ws_host *host);

/// Returns non-zero while a step callback of this host runs.
int ws_host_in_callback(const ws_host *host);

/// Refuses call `call` while a step callback of this host runs: writes "CALL:
/// called from inside a step callback (...)" into `error` and returns
/// WS_ESTATE; returns WS_OK otherwise.
int ws_host_refuse_in_callback(const ws_host *host, const char *call,
                               char *error, size_t size);

/// Returns the directory wsync's Lua scripts come from, or "" when they come
/// from the embedded bytecode.
const char *ws_host_script_root(const ws_host *host);

/// Stores the function (or nil) at `index` of the host's state `L` as the
/// handler of errors raised in libuv callbacks (wsync.loop installs it).
void ws_host_set_callback_error_handler(lua_State *L, int index);
