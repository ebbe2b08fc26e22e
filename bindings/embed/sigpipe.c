// SIGPIPE blocked while wsync's code runs (sigpipe.h). A write to a socket or
// pipe whose reader left raises SIGPIPE in the writing thread: blocked, it
// stays pending instead of acting, and sigtimedwait takes it before the mask
// is restored, so the caller's disposition (SIG_DFL kills) never sees it.
#include "sigpipe.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <time.h>

// The innermost guard of this thread, or NULL outside wsync's code.
static _Thread_local ws_sigpipe_guard *innermost;

static sigset_t sigpipe_set(void) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE);
  return set;
}

static int sigpipe_pending(void) {
  sigset_t pending;
  return sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE);
}

// Blocks SIGPIPE; records whether the caller had it unblocked and whether one
// is pending already (the caller's, not wsync's).
static void block(ws_sigpipe_guard *guard) {
  sigset_t set = sigpipe_set(), previous;
  pthread_sigmask(SIG_BLOCK, &set, &previous);
  guard->unblock = !sigismember(&previous, SIGPIPE);
  guard->was_pending = sigpipe_pending();
}

// Takes the SIGPIPE that wsync's writes made pending (the thread's, and one of
// the process's, at most two), then unblocks SIGPIPE if the caller had it so.
static void release(const ws_sigpipe_guard *guard) {
  if (!guard->was_pending && sigpipe_pending()) {
    sigset_t set = sigpipe_set();
    struct timespec now = {0, 0};
    for (int taken = 0; taken < 2;) {
      int signal_number = sigtimedwait(&set, NULL, &now);
      if (signal_number == SIGPIPE)
        taken++;
      else if (!(signal_number < 0 && errno == EINTR))
        break;
    }
  }
  if (guard->unblock) {
    sigset_t set = sigpipe_set();
    pthread_sigmask(SIG_UNBLOCK, &set, NULL);
  }
}

void ws_sigpipe_enter(ws_sigpipe_guard *guard) {
  block(guard);
  guard->outer = innermost;
  innermost = guard;
}

void ws_sigpipe_leave(ws_sigpipe_guard *guard) {
  innermost = guard->outer;
  release(guard);
}

void ws_sigpipe_suspend(void) {
  if (innermost != NULL)
    release(innermost);
}

void ws_sigpipe_resume(void) {
  if (innermost != NULL)
    block(innermost);
}
