// SIGPIPE while wsync's code runs in a caller's thread: blocked, so that a
// write to a peer that died fails with EPIPE instead of killing the process,
// and consumed afterwards when wsync's writes raised it. The process's signal
// dispositions are never touched: they belong to the program that embeds
// wsync. Every entry point of wsync.h that runs Lua or the loop holds a guard;
// a step callback runs with the caller's mask (ws_sigpipe_suspend).
#pragma once

/// What one entry point changed of its thread's SIGPIPE state. Guards nest
/// (an entry point called from a step callback); each thread knows its
/// innermost.
typedef struct ws_sigpipe_guard {
  int unblock;     // the caller had SIGPIPE unblocked: unblock it when leaving
  int was_pending; // a SIGPIPE was pending before wsync's code ran: kept
  struct ws_sigpipe_guard *outer; // the guard this one runs inside, or NULL
} ws_sigpipe_guard;

/// Blocks SIGPIPE in the calling thread until ws_sigpipe_leave(guard).
void ws_sigpipe_enter(ws_sigpipe_guard *guard);

/// Consumes a SIGPIPE that wsync's code made pending (one pending before
/// ws_sigpipe_enter stays) and restores the thread's SIGPIPE mask.
void ws_sigpipe_leave(ws_sigpipe_guard *guard);

/// Before a step callback, inside the thread's innermost guard: consumes
/// wsync's SIGPIPE and gives the callback the caller's mask.
void ws_sigpipe_suspend(void);

/// After the step callback: blocks SIGPIPE again for wsync's code.
void ws_sigpipe_resume(void);
