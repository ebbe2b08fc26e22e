// The embedding host: one LuaJIT state, one libuv loop, the wsync modules.
//
// This file is the only place that owns a lua_State. It preloads the native
// modules (luv wired to the host's loop, cjson, the wsync bindings), installs
// the loader for wsync's Lua scripts (source tree in development, embedded
// bytecode otherwise), routes every libuv callback through one protected-call
// helper, and tears everything down in order on close.
#include <stdint.h>

#include "wsync.h"

#include "bindings.h"
#include "scripts.h"
#include "status.h"

#include <lauxlib.h>
#include <lua.h>
#include <luajit.h>
#include <lualib.h>
#include <luv/luv.h>
#include <uv.h>

#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int luaopen_cjson(lua_State *L);

struct ws_host {
  lua_State *L;
  uv_loop_t loop;
  int loop_open;
  int lua_ready;    // the wsync modules are set up in L
  ws_agent *agents; // open agents (agent.c keeps the list)
  char script_root[PATH_MAX];
  char error[8192];
};

static const char host_registry_key = 'h';
static const char callback_handler_key = 'c';
static const char exit_metatable_key = 'x';

// ---------------------------------------------------------------------------
// Errors and protected calls

/// Message handler for every protected call: strings get a traceback; error
/// objects (tables) keep their identity and gain a `traceback` field; the exit
/// sentinel raised by os.exit passes untouched.
int ws_lua_message_handler(lua_State *L) {
  if (lua_type(L, 1) == LUA_TTABLE) {
    int is_exit = 0;
    if (lua_getmetatable(L, 1)) { // a plain table has none: nothing pushed
      lua_pushlightuserdata(L, (void *)&exit_metatable_key);
      lua_rawget(L, LUA_REGISTRYINDEX);
      is_exit = lua_rawequal(L, -1, -2);
      lua_pop(L, 2);
    }
    if (is_exit)
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

// Converts the error value on top of the stack to text in host->error: an
// error object's __tostring plus its traceback, or the string itself.
static void record_error(ws_host *host, lua_State *L) {
  ws_lua_error_text(L, -1, host->error, sizeof host->error);
}

// Reads the exit code from an exit sentinel on top of the stack; returns 0 and
// leaves *code alone when the value is not one.
static int exit_sentinel_code(lua_State *L, int *code) {
  if (lua_type(L, -1) != LUA_TTABLE || !lua_getmetatable(L, -1))
    return 0;
  lua_pushlightuserdata(L, (void *)&exit_metatable_key);
  lua_rawget(L, LUA_REGISTRYINDEX);
  int is_exit = lua_rawequal(L, -1, -2);
  lua_pop(L, 2);
  if (is_exit) {
    lua_getfield(L, -1, "code");
    *code = (int)lua_tointeger(L, -1);
    lua_pop(L, 1);
  }
  return is_exit;
}

/// luv's callback hook: runs every libuv callback under the message handler.
/// On failure the error goes to the Lua handler that wsync.loop installed (it
/// decides whether the loop stops); without one it is printed. Never exits.
static int callback_pcall(lua_State *L, int nargs, int nresults, int flags) {
  (void)flags;
  int base = lua_gettop(L) - nargs; // index of the function
  lua_pushcfunction(L, ws_lua_message_handler);
  lua_insert(L, base); // [handler, function, args...]
  int status = lua_pcall(L, nargs, nresults, base);
  if (status == 0) {
    lua_remove(L, base);
    return lua_gettop(L) - base + 1;
  }
  // [handler, error]
  lua_pushlightuserdata(L, (void *)&callback_handler_key);
  lua_rawget(L, LUA_REGISTRYINDEX); // [handler, error, report]
  int reported = 0;
  if (lua_isfunction(L, -1)) {
    lua_pushvalue(L, -2); // [handler, error, report, error]
    reported = lua_pcall(L, 1, 0, 0) == 0;
    if (!reported) {
      fprintf(stderr, "wsync: the callback error handler failed: %s\n",
              lua_tostring(L, -1) ? lua_tostring(L, -1) : "?");
      lua_pop(L, 1);
    }
  } else {
    lua_pop(L, 1);
  }
  if (!reported) {
    const char *message = lua_tostring(L, -1);
    fprintf(stderr, "wsync: error in a libuv callback: %s\n",
            message ? message : "(error object)");
  }
  lua_settop(L, base - 1);
  return -status;
}

// ---------------------------------------------------------------------------
// Interrupts (Ctrl-C) for REPL chunks

static ws_host *host_of(lua_State *L);

// The main Lua state of the host that armed the handler (hooks are global to
// a LuaJIT state, so the main state reaches the chunk's coroutine too), and
// that host. One SIGINT handler per process: the host that arms last owns it.
static lua_State *volatile interrupt_state;
static ws_host *interrupt_host;

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
    lua_sethook(L, interrupt_hook,
                LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
}

static struct sigaction interrupt_previous;
static int interrupt_armed;

// _host.arm_interrupt(): from now until disarm_interrupt(), SIGINT raises the
// Lua error "interrupted" in whatever Lua code runs (the REPL arms it around
// each chunk; loops it compiles run interpreted so that the hook is seen).
static int host_arm_interrupt(lua_State *L) {
  ws_host *host = host_of(L);
  interrupt_host = host;
  interrupt_state = host->L; // never a coroutine, which may be collected
  if (interrupt_armed)
    return 0;
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_handler = on_interrupt;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, &interrupt_previous);
  interrupt_armed = 1;
  return 0;
}

// Restores the SIGINT handler that was in place and drops a pending hook.
static void disarm(ws_host *host) {
  sigaction(SIGINT, &interrupt_previous, NULL);
  interrupt_armed = 0;
  interrupt_state = NULL;
  interrupt_host = NULL;
  lua_sethook(host->L, NULL, 0, 0);
}

// _host.disarm_interrupt(): undoes this host's arm_interrupt (another host's
// arm is left alone).
static int host_disarm_interrupt(lua_State *L) {
  if (interrupt_armed && interrupt_host == host_of(L))
    disarm(interrupt_host);
  return 0;
}

// ---------------------------------------------------------------------------
// The `wsync._host` module

static ws_host *host_of(lua_State *L) {
  lua_pushlightuserdata(L, (void *)&host_registry_key);
  lua_rawget(L, LUA_REGISTRYINDEX);
  ws_host *host = lua_touserdata(L, -1);
  lua_pop(L, 1);
  return host;
}

// _host.set_callback_error_handler(fn | nil)
static int host_set_callback_error_handler(lua_State *L) {
  if (!lua_isnoneornil(L, 1))
    luaL_checktype(L, 1, LUA_TFUNCTION);
  lua_settop(L, 1);
  lua_pushlightuserdata(L, (void *)&callback_handler_key);
  lua_insert(L, 1);
  lua_rawset(L, LUA_REGISTRYINDEX);
  return 0;
}

// _host.script_root() -> path | nil (nil: embedded bytecode)
static int host_script_root(lua_State *L) {
  ws_host *host = host_of(L);
  if (host->script_root[0] == '\0')
    lua_pushnil(L);
  else
    lua_pushstring(L, host->script_root);
  return 1;
}

// _host.embedded_modules() -> {name, ...}
static int host_embedded_modules(lua_State *L) {
  lua_newtable(L);
  for (int i = 0; ws_embedded_scripts[i].name != NULL; i++) {
    lua_pushstring(L, ws_embedded_scripts[i].name);
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

// _host.exit([code]) raises the exit sentinel; the top level turns it into the
// process exit code after an orderly shutdown. Installed as os.exit.
static int host_exit(lua_State *L) {
  int code = 0;
  if (lua_isboolean(L, 1))
    code = lua_toboolean(L, 1) ? 0 : 1;
  else
    code = (int)luaL_optinteger(L, 1, 0);
  lua_createtable(L, 0, 1);
  lua_pushinteger(L, code);
  lua_setfield(L, -2, "code");
  lua_pushlightuserdata(L, (void *)&exit_metatable_key);
  lua_rawget(L, LUA_REGISTRYINDEX);
  lua_setmetatable(L, -2);
  return lua_error(L);
}

// _host.pid() -> this process's id
static int host_pid(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)getpid());
  return 1;
}

static int luaopen_wsync_host(lua_State *L) {
  static const luaL_Reg functions[] = {
      {"arm_interrupt", host_arm_interrupt},
      {"disarm_interrupt", host_disarm_interrupt},
      {"set_callback_error_handler", host_set_callback_error_handler},
      {"script_root", host_script_root},
      {"embedded_modules", host_embedded_modules},
      {"exit", host_exit},
      {"pid", host_pid},
      {"message_handler", ws_lua_message_handler},
      {NULL, NULL},
  };
  lua_newtable(L);
  luaL_register(L, NULL, functions);
  return 1;
}

// ---------------------------------------------------------------------------
// Script loading

static int file_exists(const char *path) {
  struct stat info;
  return stat(path, &info) == 0 && S_ISREG(info.st_mode);
}

// package.loaders entry for "wsync" and "wsync.*": source tree or bytecode.
static int load_wsync_module(lua_State *L) {
  const char *name = luaL_checkstring(L, 1);
  if (strcmp(name, "wsync") != 0 && strncmp(name, "wsync.", 6) != 0) {
    lua_pushstring(L, "\n\tnot a wsync module");
    return 1;
  }
  ws_host *host = host_of(L);
  if (host->script_root[0] != '\0') {
    luaL_Buffer path;
    luaL_buffinit(L, &path);
    luaL_addstring(&path, host->script_root);
    luaL_addchar(&path, '/');
    for (const char *c = name; *c; c++)
      luaL_addchar(&path, *c == '.' ? '/' : *c);
    luaL_pushresult(&path); // [name, base]
    const char *base = lua_tostring(L, -1);
    const char *file = lua_pushfstring(L, "%s.lua", base);
    if (!file_exists(file)) {
      lua_pop(L, 1);
      file = lua_pushfstring(L, "%s/init.lua", base);
    }
    if (!file_exists(file)) {
      lua_pushfstring(L, "\n\tno file '%s.lua' or '%s/init.lua'", base, base);
      return 1;
    }
    if (luaL_loadfile(L, file) != 0)
      return lua_error(L);
    return 1;
  }
  for (int i = 0; ws_embedded_scripts[i].name != NULL; i++) {
    const ws_script *script = &ws_embedded_scripts[i];
    if (strcmp(script->name, name) == 0) {
      if (luaL_loadbuffer(L, (const char *)script->code, script->size,
                          script->chunk_name) != 0)
        return lua_error(L);
      return 1;
    }
  }
  lua_pushfstring(L, "\n\tno embedded module '%s'", name);
  return 1;
}

// Picks where wsync's Lua scripts come from: $WSYNC_SCRIPTS ("embedded" forces
// the bytecode), else the source tree when this binary runs from its build
// tree, else the embedded bytecode.
static void choose_script_root(ws_host *host) {
  host->script_root[0] = '\0';
  const char *forced = getenv("WSYNC_SCRIPTS");
  if (forced != NULL && forced[0] != '\0') {
    if (strcmp(forced, "embedded") != 0)
      snprintf(host->script_root, sizeof host->script_root, "%s", forced);
    return;
  }
#ifdef WSYNC_SOURCE_SCRIPTS
  char executable[PATH_MAX];
  ssize_t length = readlink("/proc/self/exe", executable, sizeof executable - 1);
  if (length <= 0)
    return;
  executable[length] = '\0';
  char *slash = strrchr(executable, '/');
  if (slash != NULL)
    *slash = '\0';
  char marker[PATH_MAX];
  snprintf(marker, sizeof marker, "%s/wsync/init.lua", WSYNC_SOURCE_SCRIPTS);
  if (strcmp(executable, WSYNC_BINARY_DIR) == 0 && file_exists(marker))
    snprintf(host->script_root, sizeof host->script_root, "%s",
             WSYNC_SOURCE_SCRIPTS);
#endif
}

static void install_loader(lua_State *L) {
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "loaders"); // [package, loaders]
  int count = (int)lua_objlen(L, -1);
  for (int i = count; i >= 2; i--) {
    lua_rawgeti(L, -1, i);
    lua_rawseti(L, -2, i + 1);
  }
  lua_pushcfunction(L, load_wsync_module);
  lua_rawseti(L, -2, 2); // after package.preload
  lua_pop(L, 2);
}

static void preload(lua_State *L, const char *name, lua_CFunction open) {
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "preload");
  lua_pushcfunction(L, open);
  lua_setfield(L, -2, name);
  lua_pop(L, 2);
}

// ---------------------------------------------------------------------------
// Host lifetime

static int open_state(lua_State *L) {
  ws_host *host = lua_touserdata(L, 1);
  luaL_openlibs(L);
  lua_pushlightuserdata(L, (void *)&host_registry_key);
  lua_pushlightuserdata(L, host);
  lua_rawset(L, LUA_REGISTRYINDEX);

  lua_pushlightuserdata(L, (void *)&exit_metatable_key);
  lua_createtable(L, 0, 1);
  lua_pushliteral(L, "wsync exit");
  lua_setfield(L, -2, "__name");
  lua_rawset(L, LUA_REGISTRYINDEX);

  luv_set_loop(L, &host->loop);
  luv_set_callback(L, callback_pcall);
  preload(L, "luv", luaopen_luv);
  preload(L, "cjson", luaopen_cjson);
  preload(L, "wsync._host", luaopen_wsync_host);
  preload(L, "wsync._core", luaopen_wsync_core);
  preload(L, "wsync._manifest", luaopen_wsync_manifest);
  preload(L, "wsync._shm", luaopen_wsync_shm);
  preload(L, "wsync._device", luaopen_wsync_device);
  preload(L, "wsync._process", luaopen_wsync_process);
  preload(L, "wsync._socket", luaopen_wsync_socket);
  install_loader(L);

  lua_getglobal(L, "os");
  lua_pushcfunction(L, host_exit);
  lua_setfield(L, -2, "exit");
  lua_pop(L, 1);
  return 0;
}

int ws_host_open(ws_host **out) {
  // A write to a pipe whose reader died must fail (EPIPE, then the runtime or
  // agent connection breaks with its cause), not kill the whole process.
  signal(SIGPIPE, SIG_IGN);
  ws_host *host = calloc(1, sizeof *host);
  if (host == NULL)
    return ws_fail(WS_ENOMEM, "host: cannot allocate");
  int error = uv_loop_init(&host->loop);
  if (error != 0) {
    free(host);
    return ws_fail(WS_ESYS, "host: uv_loop_init: %s", uv_strerror(error));
  }
  host->loop_open = 1;
  choose_script_root(host);
  host->L = luaL_newstate();
  if (host->L == NULL) {
    ws_host_close(host);
    return ws_fail(WS_ENOMEM, "host: cannot create a Lua state");
  }
  lua_pushcfunction(host->L, open_state);
  lua_pushlightuserdata(host->L, host);
  if (lua_pcall(host->L, 1, 0, 0) != 0) {
    const char *why = lua_tostring(host->L, -1);
    int status = ws_fail(WS_ELUA, "host: cannot set up Lua: %s",
                         why != NULL ? why : "(not a string)");
    ws_host_close(host);
    return status;
  }
  host->lua_ready = 1;
  *out = host;
  return WS_OK;
}

// Calls require(module)[function](args...) under the message handler with the
// strings in argv as a table argument. Returns 0 with the results left on the
// stack, or WS_ELUA with the error recorded (exit sentinels set *exit_code).
static int call_script(ws_host *host, const char *module, const char *function,
                       int string_count, const char *const *strings, int argc,
                       const char *const *argv, int *exit_code) {
  lua_State *L = host->L;
  if (ws_callback_depth > 0) {
    snprintf(host->error, sizeof host->error,
             "wsync.cli.%s: called from inside a step callback (wsync's loop "
             "is not reentrant)",
             function);
    return WS_ESTATE;
  }
  host->error[0] = '\0';
  lua_settop(L, 0);
  lua_pushcfunction(L, ws_lua_message_handler);
  lua_getglobal(L, "require");
  lua_pushstring(L, module);
  if (lua_pcall(L, 1, 1, 1) != 0) {
    record_error(host, L);
    lua_settop(L, 0);
    return WS_ELUA;
  }
  lua_getfield(L, -1, function);
  lua_remove(L, -2); // [handler, function]
  for (int i = 0; i < string_count; i++)
    lua_pushstring(L, strings[i]);
  lua_createtable(L, argc, 0);
  for (int i = 0; i < argc; i++) {
    lua_pushstring(L, argv[i]);
    lua_rawseti(L, -2, i + 1);
  }
  if (lua_pcall(L, string_count + 1, 1, 1) != 0) {
    int code = 1;
    if (exit_sentinel_code(L, &code)) {
      if (exit_code != NULL)
        *exit_code = code;
      lua_settop(L, 0);
      if (code == 0)
        return WS_OK;
      snprintf(host->error, sizeof host->error, "exit %d", code);
      return WS_ELUA;
    }
    record_error(host, L);
    lua_settop(L, 0);
    return WS_ELUA;
  }
  if (exit_code != NULL && lua_isnumber(L, -1))
    *exit_code = (int)lua_tointeger(L, -1);
  lua_settop(L, 0);
  return WS_OK;
}

int ws_host_run_string(ws_host *host, const char *code,
                       const char *chunk_name) {
  const char *strings[] = {code, chunk_name ? chunk_name : "=(embedded)"};
  return call_script(host, "wsync.cli", "exec_string", 2, strings, 0, NULL,
                     NULL);
}

int ws_host_run_file(ws_host *host, const char *path, int argc,
                     const char *const *argv) {
  return call_script(host, "wsync.cli", "exec_file", 1, &path, argc, argv,
                     NULL);
}

int ws_host_run_recipe(ws_host *host, const char *path, int argc,
                       const char *const *argv) {
  return call_script(host, "wsync.cli", "exec_recipe", 1, &path, argc, argv,
                     NULL);
}

int ws_host_main(ws_host *host, int argc, const char *const *argv) {
  int exit_code = 1;
  int status = call_script(host, "wsync.cli", "main", 0, NULL, argc, argv,
                           &exit_code);
  if (status != WS_OK && host->error[0] != '\0' &&
      strncmp(host->error, "exit ", 5) != 0) {
    fprintf(stderr, "wsync: %s\n", host->error);
    exit_code = 1;
  }
  return exit_code;
}

const char *ws_host_error(const ws_host *host) { return host->error; }

lua_State *ws_host_lua_state(ws_host *host) { return host->L; }

ws_agent **ws_host_agents(ws_host *host) { return &host->agents; }

void ws_host_set_error(ws_host *host, const char *text) {
  snprintf(host->error, sizeof host->error, "%s", text);
}

const char *ws_version(void) { return WSYNC_VERSION; }

// Closes every handle still open on the host's loop through luv, so that luv's
// own close callbacks release their Lua references, and runs the loop until
// the closes complete.
static void close_handles(ws_host *host) {
  lua_State *L = host->L;
  lua_settop(L, 0);
  lua_pushcfunction(L, ws_lua_message_handler);
  lua_getglobal(L, "require");
  lua_pushliteral(L, "wsync.loop");
  if (lua_pcall(L, 1, 1, 1) == 0) {
    lua_getfield(L, -1, "close_all");
    if (lua_pcall(L, 0, 0, 1) != 0)
      fprintf(stderr, "wsync: closing handles failed: %s\n",
              lua_tostring(L, -1));
  } else {
    fprintf(stderr, "wsync: cannot load wsync.loop to close handles: %s\n",
            lua_tostring(L, -1));
  }
  lua_settop(L, 0);
}

static void close_leftover_handle(uv_handle_t *handle, void *argument) {
  (void)argument;
  if (!uv_is_closing(handle))
    uv_close(handle, NULL);
}

void ws_host_close(ws_host *host) {
  if (host == NULL)
    return;
  if (ws_callback_depth > 0) {
    // The state is running the callback that called this: closing it now
    // would pull it out from under the callback.
    snprintf(host->error, sizeof host->error,
             "ws_host_close: called from inside a step callback; the host "
             "stays open");
    return;
  }
  ws_agents_detach(host->agents);
  host->agents = NULL;
  if (host->L != NULL) {
    if (interrupt_armed && interrupt_host == host)
      disarm(host);
    if (host->loop_open && host->lua_ready)
      close_handles(host);
    lua_close(host->L);
    host->L = NULL;
  }
  if (host->loop_open) {
    // Anything still open escaped wsync.loop.close_all: close it here.
    uv_walk(&host->loop, close_leftover_handle, NULL);
    uv_run(&host->loop, UV_RUN_DEFAULT);
    uv_loop_close(&host->loop);
    host->loop_open = 0;
  }
  free(host);
}
