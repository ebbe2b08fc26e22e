// Ctrl-C for REPL chunks (interrupt.h): a SIGINT handler that sets a Lua hook,
// and the hook that raises "interrupted" in the chunk.
#include "interrupt.h"

#include <lauxlib.h>

#include <signal.h>
#include <string.h>

// The state that armed the handler (hooks are global to a LuaJIT state, so the
// main state reaches the chunk's coroutine too), and who armed it.
static lua_State *volatile interrupt_state;
static const void *interrupt_owner;
static struct sigaction interrupt_previous;
static int interrupt_armed;

static void interrupt_hook(lua_State *L, lua_Debug *debug) {
  (void)debug;
  // Chunks run in coroutines. On the main thread this is the loop's own code
  // between two resumes (or the disarm call itself): keep the hook, so that
  // the interrupt lands in the chunk when it runs again, or is dropped by
  // disarm when the chunk is done.
  if (lua_pushthread(L)) {
    lua_pop(L, 1);
    return;
  }
  lua_pop(L, 1);
  lua_sethook(L, NULL, 0, 0);
  luaL_error(L, "interrupted");
}

static void on_interrupt(int signal_number) {
  (void)signal_number;
  lua_State *L = interrupt_state;
  if (L != NULL)
    lua_sethook(L, interrupt_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT,
                1);
}

void ws_interrupt_arm(lua_State *L, const void *owner) {
  interrupt_owner = owner;
  interrupt_state = L;
  if (interrupt_armed)
    return;
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_handler = on_interrupt;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, &interrupt_previous);
  interrupt_armed = 1;
}

void ws_interrupt_disarm(const void *owner) {
  if (!interrupt_armed || interrupt_owner != owner)
    return;
  lua_State *L = interrupt_state;
  sigaction(SIGINT, &interrupt_previous, NULL);
  interrupt_armed = 0;
  interrupt_state = NULL;
  interrupt_owner = NULL;
  lua_sethook(L, NULL, 0, 0);
}
