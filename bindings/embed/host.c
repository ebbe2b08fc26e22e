// The embedding host and the public API of wsync.h that runs it: one LuaJIT
// state, one libuv loop, the wsync modules.
//
// This file is the only place that owns a lua_State. It preloads the native
// modules (luv wired to the host's loop, cjson, the wsync bindings), installs
// the loader of wsync's Lua scripts (script_loader.c), routes every libuv
// callback through one protected-call helper, blocks SIGPIPE while its entry
// points run Lua or the loop (sigpipe.h), and tears everything down in order
// on close. It knows nothing of agents: they hold the host's link, which
// close clears.
#include <stdint.h>

#include "wsync.h"

#include "host_internal.h"
#include "interrupt.h"
#include "lua_util.h"
#include "modules.h"
#include "script_loader.h"
#include "sigpipe.h"
#include "status.h"

#include <lauxlib.h>
#include <lua.h>
#include <luajit.h>
#include <lualib.h>
#include <luv/luv.h>
#include <uv.h>

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int luaopen_cjson(lua_State *L);

struct ws_host {
  lua_State *L;
  uv_loop_t loop;
  int loop_open;
  int lua_ready;      // the wsync modules are set up in L
  int callback_depth; // step callbacks running now (ws_host_enter_callback)
  ws_host_link *link; // what agents hold; cleared on close
  char script_root[PATH_MAX];
  char error[8192];
};

static const char host_registry_key = 'h';
static const char callback_handler_key = 'c';

// Why the last ws_host_open or ws_agent_open on this thread failed.
static _Thread_local char last_error[8192];

// ---------------------------------------------------------------------------
// What the host's other parts use (host_internal.h)

lua_State *ws_host_lua_state(ws_host *host) { return host->L; }

ws_host *ws_host_from_state(lua_State *L) {
  lua_pushlightuserdata(L, (void *)&host_registry_key);
  lua_rawget(L, LUA_REGISTRYINDEX);
  ws_host *host = lua_touserdata(L, -1);
  lua_pop(L, 1);
  return host;
}

ws_host_link *ws_host_link_of(ws_host *host) { return host->link; }

void ws_host_set_error(ws_host *host, const char *text) {
  snprintf(host->error, sizeof host->error, "%s", text);
}

void ws_set_last_error(const char *text) {
  snprintf(last_error, sizeof last_error, "%s", text);
}

void ws_host_enter_callback(ws_host *host) { host->callback_depth++; }

void ws_host_leave_callback(ws_host *host) { host->callback_depth--; }

int ws_host_in_callback(const ws_host *host) {
  return host->callback_depth > 0;
}

int ws_host_refuse_in_callback(const ws_host *host, const char *call,
                               char *error, size_t size) {
  if (!ws_host_in_callback(host))
    return WS_OK;
  snprintf(error, size,
           "%s: called from inside a step callback (wsync's loop is not "
           "reentrant)",
           call);
  return WS_ESTATE;
}

const char *ws_host_script_root(const ws_host *host) {
  return host->script_root;
}

void ws_host_set_callback_error_handler(lua_State *L, int index) {
  lua_pushlightuserdata(L, (void *)&callback_handler_key);
  lua_pushvalue(L, index);
  lua_rawset(L, LUA_REGISTRYINDEX);
}

// ---------------------------------------------------------------------------
// libuv callbacks

// luv's callback hook: runs every libuv callback under the message handler.
// On failure the error goes to the Lua handler that wsync.loop installed (it
// decides whether the loop stops); without one it is printed. Never exits.
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
// Host lifetime

static void preload(lua_State *L, const char *name, lua_CFunction open) {
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "preload");
  lua_pushcfunction(L, open);
  lua_setfield(L, -2, name);
  lua_pop(L, 2);
}

// Sets up the host's state, run protected: [host].
static int open_state(lua_State *L) {
  ws_host *host = lua_touserdata(L, 1);
  luaL_openlibs(L);
  lua_pushlightuserdata(L, (void *)&host_registry_key);
  lua_pushlightuserdata(L, host);
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
  preload(L, "wsync._cuda", luaopen_wsync_cuda);
  preload(L, "wsync._nccl", luaopen_wsync_nccl);
  preload(L, "wsync._process", luaopen_wsync_process);
  preload(L, "wsync._socket", luaopen_wsync_socket);
  ws_scripts_install_loader(L, host->script_root);

  // os.exit = require("wsync._host").exit
  lua_getglobal(L, "require");
  lua_pushliteral(L, "wsync._host");
  lua_call(L, 1, 1); // [host, module]
  lua_getglobal(L, "os");
  lua_getfield(L, -2, "exit");
  lua_setfield(L, -2, "exit");
  lua_pop(L, 2);
  return 0;
}

// Copies the core's detail of the failure `status` (ws_fail) into this
// thread's ws_last_error and returns `status`.
static int open_failed(int status) {
  ws_set_last_error(ws_error_detail());
  return status;
}

int ws_host_open(ws_host **out) {
  last_error[0] = '\0';
  if (out == NULL)
    return open_failed(ws_fail(WS_EINVAL, "ws_host_open: out is NULL"));
  *out = NULL;
  ws_host *host = calloc(1, sizeof *host);
  if (host == NULL)
    return open_failed(ws_fail(WS_ENOMEM, "ws_host_open: cannot allocate"));
  host->link = ws_host_link_new(host);
  if (host->link == NULL) {
    free(host);
    return open_failed(
        ws_fail(WS_ENOMEM, "ws_host_open: cannot allocate the host link"));
  }
  int error = uv_loop_init(&host->loop);
  if (error != 0) {
    ws_host_link_release(host->link);
    free(host);
    return open_failed(
        ws_fail(WS_ESYS, "ws_host_open: uv_loop_init: %s", uv_strerror(error)));
  }
  host->loop_open = 1;
  ws_scripts_choose_root(host->script_root, sizeof host->script_root);
  host->L = luaL_newstate();
  if (host->L == NULL) {
    int status = open_failed(
        ws_fail(WS_ENOMEM, "ws_host_open: cannot create a Lua state"));
    ws_host_close(host);
    return status;
  }
  lua_pushcfunction(host->L, open_state);
  lua_pushlightuserdata(host->L, host);
  ws_sigpipe_guard guard;
  ws_sigpipe_enter(&guard);
  int failed = lua_pcall(host->L, 1, 0, 0) != 0;
  ws_sigpipe_leave(&guard);
  if (failed) {
    const char *why = lua_tostring(host->L, -1);
    int status =
        open_failed(ws_fail(WS_ELUA, "ws_host_open: cannot set up Lua: %s",
                            why != NULL ? why : "(not a string)"));
    ws_host_close(host);
    return status;
  }
  host->lua_ready = 1;
  *out = host;
  return WS_OK;
}

// Records the error value at `index` in the host's error text, as wsync's
// C API gives it (ws_lua_error_coded: a wsync error with its code, its
// traceback only for a bug or with $WSYNC_TRACEBACK=1); returns its status:
// WS_EINVAL for what the caller gave (a recipe, a script, arguments:
// errors.py's CALLER_CODES),
// WS_EFAILED for any other wsync error, WS_ELUA for a Lua error (a bug).
static int record_failure(ws_host *host, int index) {
  char code[64];
  ws_lua_error_coded(host->L, index, host->error, sizeof host->error, code,
                     sizeof code);
  if (code[0] == '\0' || strcmp(code, "LUA_ERROR") == 0)
    return WS_ELUA;
  if (strcmp(code, "RECIPE_INVALID") == 0 ||
      strcmp(code, "SCRIPT_INVALID") == 0 || strcmp(code, "USAGE") == 0 ||
      strcmp(code, "INVALID_ARGUMENT") == 0)
    return WS_EINVAL;
  return WS_EFAILED;
}

// Calls require(module)[function](strings..., argv) under the message
// handler, argv as a table. Returns 0 with the result copied into `text` (when
// given) and the stack emptied, or a negative status with the error recorded
// (exit sentinels set *exit_code).
static int run_script(ws_host *host, const char *module, const char *function,
                      int string_count, const char *const *strings, int argc,
                      const char *const *argv, int *exit_code, char *text,
                      size_t text_size) {
  lua_State *L = host->L;
  host->error[0] = '\0';
  lua_settop(L, 0);
  lua_pushcfunction(L, ws_lua_message_handler);
  lua_getglobal(L, "require");
  lua_pushstring(L, module);
  if (lua_pcall(L, 1, 1, 1) != 0) {
    int status = record_failure(host, -1);
    lua_settop(L, 0);
    return status;
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
    if (ws_lua_exit_code(L, -1, &code)) {
      if (exit_code != NULL)
        *exit_code = code;
      lua_settop(L, 0);
      if (code == 0)
        return WS_OK;
      snprintf(host->error, sizeof host->error, "exit %d", code);
      return WS_ELUA;
    }
    int status = record_failure(host, -1);
    lua_settop(L, 0);
    return status;
  }
  if (exit_code != NULL && lua_isnumber(L, -1))
    *exit_code = (int)lua_tointeger(L, -1);
  if (text != NULL && text_size > 0) {
    const char *result = lua_tostring(L, -1);
    size_t length = 0;
    if (result != NULL)
      length = lua_objlen(L, -1);
    if (result == NULL || length >= text_size) {
      snprintf(host->error, sizeof host->error,
               "%s.%s: its result (%zu bytes) does not fit the %zu bytes "
               "given",
               module, function, length + 1, text_size);
      lua_settop(L, 0);
      return WS_EINVAL;
    }
    memcpy(text, result, length + 1);
  }
  lua_settop(L, 0);
  return WS_OK;
}

// run_script, refused from inside a step callback, with SIGPIPE blocked.
static int call_script_text(ws_host *host, const char *module,
                            const char *function, int string_count,
                            const char *const *strings, int argc,
                            const char *const *argv, int *exit_code, char *text,
                            size_t text_size) {
  char call[64];
  snprintf(call, sizeof call, "wsync.cli.%s", function);
  int status =
      ws_host_refuse_in_callback(host, call, host->error, sizeof host->error);
  if (status != WS_OK)
    return status;
  ws_sigpipe_guard guard;
  ws_sigpipe_enter(&guard);
  status = run_script(host, module, function, string_count, strings, argc,
                      argv, exit_code, text, text_size);
  ws_sigpipe_leave(&guard);
  return status;
}

static int call_script(ws_host *host, const char *module, const char *function,
                       int string_count, const char *const *strings, int argc,
                       const char *const *argv, int *exit_code) {
  return call_script_text(host, module, function, string_count, strings, argc,
                          argv, exit_code, NULL, 0);
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

// Checks a call's arguments: the host ("CALL: host is NULL" in this thread's
// ws_last_error when it is missing), then the others unless `complete`
// ("CALL: REQUIRED are required" in the host's error).
static int check_call(ws_host *host, const char *call, int complete,
                      const char *required) {
  if (host == NULL) {
    char text[128];
    snprintf(text, sizeof text, "%s: host is NULL", call);
    ws_set_last_error(text);
    return WS_EINVAL;
  }
  if (!complete) {
    snprintf(host->error, sizeof host->error, "%s: %s are required", call,
             required);
    return WS_EINVAL;
  }
  return WS_OK;
}

// Runs wsync.cli.embedded's `function` on `argument` (and argv), its answer
// into `text`, once call `call` has what it needs (`required`, named in the
// refusal).
static int call_embedded(ws_host *host, const char *call, const char *function,
                         const char *argument, int argc,
                         const char *const *argv, char *text, size_t text_size,
                         const char *required) {
  int status = check_call(host, call,
                          argument != NULL && text != NULL && text_size > 0,
                          required);
  if (status != WS_OK)
    return status;
  text[0] = '\0';
  return call_script_text(host, "wsync.cli.embedded", function, 1, &argument,
                          argc, argv, NULL, text, text_size);
}

int ws_host_start_recipe(ws_host *host, const char *path, int argc,
                         const char *const *argv, char *endpoint,
                         size_t endpoint_size) {
  return call_embedded(host, "ws_host_start_recipe", "start_recipe", path,
                       argc, argv, endpoint, endpoint_size,
                       "a path and an endpoint buffer");
}

int ws_host_eval(ws_host *host, const char *code, char *result,
                 size_t result_size) {
  return call_embedded(host, "ws_host_eval", "eval", code, 0, NULL, result,
                       result_size, "code and a result buffer");
}

int ws_host_call(ws_host *host, const char *name, const char *args_json,
                 char *result, size_t result_size) {
  int status = check_call(host, "ws_host_call",
                          name != NULL && args_json != NULL && result != NULL &&
                              result_size > 0,
                          "a name, arguments and a result buffer");
  if (status != WS_OK)
    return status;
  result[0] = '\0';
  const char *strings[] = {name, args_json};
  return call_script_text(host, "wsync.cli.embedded", "call", 2, strings, 0,
                          NULL, NULL, result, result_size);
}

int ws_host_finish_recipe(ws_host *host) {
  int status = check_call(host, "ws_host_finish_recipe", 1, NULL);
  if (status != WS_OK)
    return status;
  return call_script(host, "wsync.cli.embedded", "finish_recipe", 0, NULL, 0,
                     NULL, NULL);
}

int ws_host_main(ws_host *host, int argc, const char *const *argv) {
  int exit_code = 1;
  int status =
      call_script(host, "wsync.cli", "main", 0, NULL, argc, argv, &exit_code);
  if (status != WS_OK && host->error[0] != '\0' &&
      strncmp(host->error, "exit ", 5) != 0) {
    fprintf(stderr, "wsync: %s\n", host->error);
    exit_code = 1;
  }
  return exit_code;
}

const char *ws_host_error(const ws_host *host) { return host->error; }

const char *ws_last_error(void) { return last_error; }

const char *ws_version(void) { return WSYNC_VERSION; }

// True when package.loaded[name] is set (the module was required).
static int package_loaded(lua_State *L, const char *name) {
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "loaded");
  lua_getfield(L, -1, name);
  int loaded = !lua_isnil(L, -1);
  lua_pop(L, 3);
  return loaded;
}

// Calls require(module)[function]() under the message handler at index 1,
// saying on stderr when the call fails ("wsync: WHAT failed: ..."). Returns 0,
// the loader's error on top, when the module cannot be loaded.
static int call_module_function(lua_State *L, const char *module,
                                const char *function, const char *what) {
  lua_getglobal(L, "require");
  lua_pushstring(L, module);
  if (lua_pcall(L, 1, 1, 1) != 0)
    return 0;
  lua_getfield(L, -1, function);
  if (lua_pcall(L, 0, 0, 1) != 0)
    fprintf(stderr, "wsync: %s failed: %s\n", what, lua_tostring(L, -1));
  return 1;
}

// Closes every handle still open on the host's loop through luv, so that luv's
// own close callbacks release their Lua references, and runs the loop until
// the closes complete.
static void close_handles(ws_host *host) {
  lua_State *L = host->L;
  lua_settop(L, 0);
  lua_pushcfunction(L, ws_lua_message_handler);
  // A session started by ws_host_start_recipe and not finished: stopped
  // fail-stop before its handles go.
  if (package_loaded(L, "wsync.cli.embedded")) {
    call_module_function(L, "wsync.cli.embedded", "abort",
                         "stopping the host's session");
    lua_settop(L, 1);
  }
  if (!call_module_function(L, "wsync.loop", "close_all", "closing handles"))
    fprintf(stderr, "wsync: cannot load wsync.loop to close handles: %s\n",
            lua_tostring(L, -1));
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
  if (ws_host_in_callback(host)) {
    // The state is running the callback that called this: closing it now
    // would pull it out from under the callback.
    snprintf(host->error, sizeof host->error,
             "ws_host_close: called from inside a step callback; the host "
             "stays open");
    return;
  }
  // Agents still open find the link cleared and refuse every call but close.
  ws_host_link_clear(host->link);
  ws_host_link_release(host->link);
  host->link = NULL;
  ws_sigpipe_guard guard;
  ws_sigpipe_enter(&guard);
  if (host->L != NULL) {
    ws_interrupt_disarm(host);
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
  ws_sigpipe_leave(&guard);
  free(host);
}
