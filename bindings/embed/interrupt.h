// Ctrl-C for REPL chunks: while armed, SIGINT raises the Lua error
// "interrupted" in whatever Lua code runs in the armed state. One SIGINT
// handler per process: the owner that arms last holds it.
#pragma once

#include <lua.h>

/// Arms the interrupt for the main Lua state `L` (never a coroutine, which may
/// be collected) on behalf of `owner`; the previous SIGINT handler is kept
/// for ws_interrupt_disarm.
void ws_interrupt_arm(lua_State *L, const void *owner);

/// Restores the previous SIGINT handler and drops a pending hook, when
/// `owner` armed the interrupt last; does nothing otherwise.
void ws_interrupt_disarm(const void *owner);
