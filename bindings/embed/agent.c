// The agent API of libwsync (ws_agent_* in wsync.h): a trainer rank written in
// C joins a host's publications. The agent is a wsync.trainer.agent_api handle in the
// Lua state of the rank's own host; each function here checks its arguments,
// calls one function of that module under the message handler, and converts
// the result. Policy (states, waiting on the loop, error texts) is in Lua.
//
// Step callbacks are C function pointers that Lua calls through a trampoline
// closure holding the pointer and its user data as upvalues; the trampoline
// returns the callback's status and whether it ran to its end (a confirmed
// callback reports that through `*done`). The interrupt check is called the
// same way. A callback runs inside the loop that a ws_agent_* call drives, so
// no wsync call may nest in it: the loop is not reentrant. The trampoline marks
// the callback on the host (ws_host_enter_callback), and the host refuses what
// would nest.
//
// The agent holds its host's link, not the host: ws_host_close clears the
// link, and every later call but ws_agent_close fails with WS_ESTATE.
#include <stdint.h>

#include "wsync.h"

#include "host_internal.h"
#include "lua_util.h"
#include "manifest.h"
#include "sigpipe.h"
#include "status.h"

#include <lauxlib.h>
#include <lua.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ws_agent {
  ws_host_link *link; // the rank's own host; cleared when it closes
  int handle;       // registry reference to the wsync.trainer.agent_api handle
  char error[8192]; // last error text
  char *report;     // the last publish's round report (JSON), or NULL
  char *generation; // what the last publish generated for the rank (JSON)
};

// A step callback of either kind: `confirmed` when it reports through
// `*done` that it ran to its end, `plain` otherwise.
typedef struct agent_callback {
  int (*plain)(void *user_data);
  int (*confirmed)(void *user_data, int *done);
} agent_callback;

// Lua numbers hold integers exactly up to 2^53.
static const int64_t largest_exact_integer = (int64_t)1 << 53;

// Maps a status name from agent_api ("EFAILED") to its code.
static int status_from_name(const char *name) {
  // A failure named "OK" (or nothing) is a bug in agent_api: report it as one.
#define WS_STATUS_FROM_NAME(status_name, value, message)                       \
  if (value < 0 && name != NULL && strcmp(name, #status_name) == 0)            \
    return value;
  WS_STATUS_TABLE(WS_STATUS_FROM_NAME)
#undef WS_STATUS_FROM_NAME
  return WS_ELUA;
}

// Calls the function below the `nargs` arguments on top of the stack under
// the message handler, with SIGPIPE blocked. On success returns WS_OK with
// the results from index `*first` to the top; the caller then resets the
// stack to `*first - 2`. On failure (a raised error, or agent_api's `nil,
// message, STATUS`) writes the text into `error`, removes the function and
// its arguments and returns a negative status.
static int protected_call(lua_State *L, int nargs, int *first, char *error,
                          size_t size) {
  int handler = lua_gettop(L) - nargs; // [function, args]
  lua_pushcfunction(L, ws_lua_message_handler);
  lua_insert(L, handler); // [handler, function, args]
  ws_sigpipe_guard guard;
  ws_sigpipe_enter(&guard);
  int failed = lua_pcall(L, nargs, LUA_MULTRET, handler) != 0;
  ws_sigpipe_leave(&guard);
  if (failed) {
    ws_lua_error_text(L, -1, error, size);
    lua_settop(L, handler - 1);
    return WS_ELUA;
  }
  // [handler, results...]
  if (lua_gettop(L) > handler && lua_isnil(L, handler + 1)) {
    const char *message = lua_tostring(L, handler + 2);
    snprintf(error, size, "%s", message ? message : "(no message)");
    int status = status_from_name(lua_tostring(L, handler + 3));
    lua_settop(L, handler - 1);
    return status;
  }
  *first = handler + 1;
  return WS_OK;
}

// Pushes the agent's handle method `method` and the handle: the function and
// first argument of a method call.
static void push_method(lua_State *L, ws_agent *agent, const char *method) {
  lua_rawgeti(L, LUA_REGISTRYINDEX, agent->handle); // [handle]
  lua_getfield(L, -1, method);                      // [handle, method]
  lua_insert(L, -2);                                // [method, handle]
}

// Calls handle:method(args...) (the `nargs` arguments pushed after
// push_method) and records a failure in the agent's error text. Leaves the
// results from `*first` on success.
static int call_method(lua_State *L, ws_agent *agent, int nargs, int *first) {
  agent->error[0] = '\0';
  return protected_call(L, nargs + 1, first, agent->error, sizeof agent->error);
}

// call_method for a call whose results go unread: leaves the stack as it was
// before push_method.
static int call_method_only(lua_State *L, ws_agent *agent, int nargs) {
  int top = lua_gettop(L) - nargs - 2; // [method, handle, args]
  int first = 0;
  int status = call_method(L, agent, nargs, &first);
  lua_settop(L, top);
  return status;
}

// Checks the agent and that its host is open, and stores the host in
// `*host`: what every call but open checks, inside a step callback too;
// writes a refusal into the agent.
static int check_host(ws_agent *agent, const char *call, ws_host **host) {
  if (agent == NULL)
    return ws_fail(WS_EINVAL, "%s: agent is NULL", call);
  *host = ws_host_link_get(agent->link);
  if (*host == NULL) {
    snprintf(agent->error, sizeof agent->error,
             "%s: the agent's host was closed; only ws_agent_close remains",
             call);
    return WS_ESTATE;
  }
  return WS_OK;
}

// Checks what every call but open checks (check_host, and that no step
// callback runs) and stores the host's Lua state in `*state`; writes a
// refusal into the agent.
static int check_agent(ws_agent *agent, const char *call, lua_State **state) {
  ws_host *host = NULL;
  int status = check_host(agent, call, &host);
  if (status == WS_OK)
    status = ws_host_refuse_in_callback(host, call, agent->error,
                                        sizeof agent->error);
  if (status == WS_OK)
    *state = ws_host_lua_state(host);
  return status;
}

static int invalid(ws_agent *agent, const char *format, const char *name) {
  snprintf(agent->error, sizeof agent->error, format, name ? name : "(NULL)");
  return WS_EINVAL;
}

// Records why ws_agent_open failed, in the host's error and in this thread's
// ws_last_error, and returns `status`.
static int open_failed(ws_host *host, int status, const char *text) {
  ws_host_set_error(host, text);
  ws_set_last_error(text);
  return status;
}

int ws_agent_open(ws_host *host, const char *endpoint, int rank, int world,
                  const char *backend, int device_index, ws_agent **out) {
  ws_set_last_error("");
  if (out != NULL)
    *out = NULL;
  if (host == NULL || out == NULL) {
    ws_set_last_error("ws_agent_open: host and out are required");
    return WS_EINVAL;
  }
  char refusal[128];
  if (ws_host_refuse_in_callback(host, "ws_agent_open", refusal,
                                 sizeof refusal) != WS_OK)
    return open_failed(host, WS_ESTATE, refusal);
  if (world < 1 || rank < 0 || rank >= world) {
    char message[160];
    snprintf(message, sizeof message,
             "ws_agent_open: needs 0 <= rank < world (rank %d, world %d)",
             rank, world);
    return open_failed(host, WS_EINVAL, message);
  }
  ws_agent *agent = calloc(1, sizeof *agent);
  if (agent == NULL)
    return open_failed(host, WS_ENOMEM,
                       "ws_agent_open: cannot allocate the agent");
  lua_State *L = ws_host_lua_state(host);
  int top = lua_gettop(L);
  int first = 0;
  lua_getglobal(L, "require");
  lua_pushliteral(L, "wsync.trainer.agent_api");
  int status = protected_call(L, 1, &first, agent->error, sizeof agent->error);
  if (status == WS_OK) {
    lua_getfield(L, first, "open");
    lua_createtable(L, 0, 5);
    if (endpoint != NULL) { // (NULL: the agent reads $WSYNC_ENDPOINT)
      lua_pushstring(L, endpoint);
      lua_setfield(L, -2, "endpoint");
    }
    lua_pushinteger(L, rank);
    lua_setfield(L, -2, "rank");
    lua_pushinteger(L, world);
    lua_setfield(L, -2, "world");
    lua_pushstring(L, backend != NULL ? backend : "host");
    lua_setfield(L, -2, "backend");
    lua_pushinteger(L, device_index >= 0 ? device_index : rank);
    lua_setfield(L, -2, "device_index"); // [module, open, options]
    status = protected_call(L, 1, &first, agent->error, sizeof agent->error);
  }
  if (status != WS_OK) {
    lua_settop(L, top);
    open_failed(host, status, agent->error);
    free(agent);
    return status;
  }
  lua_pushvalue(L, first);
  agent->handle = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_settop(L, top);
  agent->link = ws_host_link_retain(ws_host_link_of(host));
  *out = agent;
  return WS_OK;
}

int ws_agent_register_tensor(ws_agent *agent, const char *name,
                             const char *dtype, const int64_t *shape, int dims,
                             void *data, uint64_t data_bytes, int64_t first_row,
                             int64_t row_count) {
  lua_State *L = NULL;
  int status = check_agent(agent, "ws_agent_register_tensor", &L);
  if (status != WS_OK)
    return status;
  if (name == NULL || dtype == NULL || shape == NULL || dims < 1 ||
      dims > WS_MANIFEST_MAX_DIMS)
    return invalid(agent,
                   "ws_agent_register_tensor %s: needs a name, a dtype and a "
                   "shape of 1 to 8 dims",
                   name);
  if (data == NULL && row_count != 0)
    return invalid(agent, "ws_agent_register_tensor %s: data is NULL", name);
  for (int d = 0; d < dims; d++)
    if (shape[d] < 0 || shape[d] > largest_exact_integer)
      return invalid(agent,
                     "ws_agent_register_tensor %s: a dim is negative "
                     "or above 2^53",
                     name);
  if (first_row < 0 || row_count < 0 || first_row > largest_exact_integer ||
      row_count > largest_exact_integer ||
      data_bytes > (uint64_t)largest_exact_integer)
    return invalid(agent,
                   "ws_agent_register_tensor %s: rows or bytes out of "
                   "range",
                   name);
  push_method(L, agent, "register_tensor");
  lua_pushstring(L, name);
  lua_pushstring(L, dtype);
  lua_createtable(L, dims, 0);
  for (int d = 0; d < dims; d++) {
    lua_pushnumber(L, (lua_Number)shape[d]);
    lua_rawseti(L, -2, d + 1);
  }
  lua_pushlightuserdata(L, data);
  lua_pushnumber(L, (lua_Number)data_bytes);
  lua_pushnumber(L, (lua_Number)first_row);
  lua_pushnumber(L, (lua_Number)row_count);
  return call_method_only(L, agent, 7);
}

int ws_agent_set_tensor_data(ws_agent *agent, const char *name, void *data,
                             uint64_t data_bytes) {
  ws_host *host = NULL;
  int status = check_host(agent, "ws_agent_set_tensor_data", &host);
  if (status != WS_OK)
    return status;
  // Unlike every other call, allowed inside a step callback: it only records
  // the pointer and runs nothing on the loop.
  if (name == NULL)
    return invalid(agent, "ws_agent_set_tensor_data %s: needs a name", name);
  if (data_bytes > (uint64_t)largest_exact_integer)
    return invalid(agent, "ws_agent_set_tensor_data %s: bytes above 2^53",
                   name);
  lua_State *L = ws_host_lua_state(host);
  push_method(L, agent, "move_tensor");
  lua_pushstring(L, name);
  lua_pushlightuserdata(L, data);
  lua_pushnumber(L, (lua_Number)data_bytes);
  return call_method_only(L, agent, 3);
}

int ws_agent_report_moved(ws_agent *agent, uint64_t bytes) {
  ws_host *host = NULL;
  int status = check_host(agent, "ws_agent_report_moved", &host);
  if (status != WS_OK)
    return status;
  // (Allowed inside a step callback, as ws_agent_set_tensor_data: it only
  // records the count.)
  if (bytes > (uint64_t)largest_exact_integer)
    return invalid(agent, "ws_agent_report_moved: bytes above 2^53%s", "");
  lua_State *L = ws_host_lua_state(host);
  push_method(L, agent, "report_moved");
  lua_pushnumber(L, (lua_Number)bytes);
  return call_method_only(L, agent, 1);
}

// The trainer's callback, called from Lua: [agent_callback box, user data]
// as upvalues; returns the callback's status and whether it ran to its end (a
// plain callback always did). Never raises.
static int callback_trampoline(lua_State *L) {
  const agent_callback *callback = lua_touserdata(L, lua_upvalueindex(1));
  void *user_data = lua_touserdata(L, lua_upvalueindex(2));
  ws_host *host = ws_host_from_state(L);
  int done = 0;
  int status;
  ws_host_enter_callback(host);
  ws_sigpipe_suspend(); // the trainer's own signal mask while it runs
  if (callback->confirmed != NULL) {
    status = callback->confirmed(user_data, &done);
  } else {
    status = callback->plain(user_data);
    done = 1;
  }
  ws_sigpipe_resume();
  ws_host_leave_callback(host);
  lua_pushinteger(L, status);
  lua_pushboolean(L, done == 1);
  return 2;
}

// Pushes the trampoline closure of `callback` and `user_data`.
static void push_trampoline(lua_State *L, agent_callback callback,
                            void *user_data) {
  agent_callback *box = lua_newuserdata(L, sizeof *box);
  *box = callback;
  lua_pushlightuserdata(L, user_data);
  lua_pushcclosure(L, callback_trampoline, 2);
}

// Registers either kind of step callback for `call`.
static int register_callback(ws_agent *agent, const char *call,
                             const char *name, agent_callback callback,
                             void *user_data) {
  lua_State *L = NULL;
  int status = check_agent(agent, call, &L);
  if (status != WS_OK)
    return status;
  if (name == NULL || (callback.plain == NULL && callback.confirmed == NULL)) {
    snprintf(agent->error, sizeof agent->error,
             "%s %s: needs a name and a function", call,
             name ? name : "(NULL)");
    return WS_EINVAL;
  }
  push_method(L, agent, "register_callback");
  lua_pushstring(L, name);
  push_trampoline(L, callback, user_data); // [method, handle, name, call]
  return call_method_only(L, agent, 2);
}

int ws_agent_register_callback(ws_agent *agent, const char *name,
                               int (*callback)(void *user_data),
                               void *user_data) {
  agent_callback box = {.plain = callback};
  return register_callback(agent, "ws_agent_register_callback", name, box,
                           user_data);
}

int ws_agent_register_confirmed_callback(ws_agent *agent, const char *name,
                                         int (*callback)(void *user_data,
                                                         int *done),
                                         void *user_data) {
  agent_callback box = {.confirmed = callback};
  return register_callback(agent, "ws_agent_register_confirmed_callback", name,
                           box, user_data);
}

int ws_agent_set_interrupt_check(ws_agent *agent,
                                 int (*check)(void *user_data, int *done),
                                 void *user_data) {
  lua_State *L = NULL;
  int status = check_agent(agent, "ws_agent_set_interrupt_check", &L);
  if (status != WS_OK)
    return status;
  push_method(L, agent, "set_interrupt_check");
  if (check != NULL) {
    agent_callback box = {.confirmed = check};
    push_trampoline(L, box, user_data); // [method, handle, call]
  } else {
    lua_pushnil(L); // [method, handle, nil]
  }
  return call_method_only(L, agent, 1);
}

int ws_agent_ready(ws_agent *agent) {
  lua_State *L = NULL;
  int status = check_agent(agent, "ws_agent_ready", &L);
  if (status != WS_OK)
    return status;
  push_method(L, agent, "ready");
  return call_method_only(L, agent, 0);
}

// Copies the string field `key` of the table at `index` into `out`.
static void copy_string_field(lua_State *L, int index, const char *key,
                              char *out, size_t size) {
  lua_getfield(L, index, key);
  const char *value = lua_tostring(L, -1);
  snprintf(out, size, "%s", value ? value : "");
  lua_pop(L, 1);
}

// Replaces `*kept` with a copy of the string field `name` of the table at
// `index` (NULL when the field is no string).
static void keep_string_field(lua_State *L, int index, const char *name,
                              char **kept) {
  lua_getfield(L, index, name);
  size_t length = 0;
  const char *text = lua_tolstring(L, -1, &length);
  char *copy = text != NULL ? malloc(length + 1) : NULL;
  if (copy != NULL)
    memcpy(copy, text, length + 1);
  free(*kept);
  *kept = copy;
  lua_pop(L, 1);
}

int ws_agent_publish(ws_agent *agent, int64_t step, ws_publish_result *result) {
  return ws_agent_publish_generate(agent, step, NULL, result);
}

int ws_agent_publish_generate(ws_agent *agent, int64_t step,
                              const char *generate_json,
                              ws_publish_result *result) {
  if (result != NULL)
    memset(result, 0, sizeof *result);
  lua_State *L = NULL;
  int status = check_agent(agent, "ws_agent_publish", &L);
  if (status != WS_OK)
    return status;
  if (step > largest_exact_integer) {
    snprintf(agent->error, sizeof agent->error,
             "ws_agent_publish: step %lld is above 2^53", (long long)step);
    return WS_EINVAL;
  }
  int top = lua_gettop(L);
  push_method(L, agent, "publish");
  if (step >= 0)
    lua_pushnumber(L, (lua_Number)step);
  else
    lua_pushnil(L);
  if (generate_json != NULL)
    lua_pushstring(L, generate_json);
  else
    lua_pushnil(L);
  int first = 0;
  status = call_method(L, agent, 2, &first);
  if (status == WS_OK && result != NULL) {
    lua_getfield(L, first, "model_version");
    result->model_version = (int64_t)lua_tonumber(L, -1);
    lua_getfield(L, first, "receipts");
    result->receipts = (int)lua_tointeger(L, -1);
    lua_pop(L, 2);
    copy_string_field(L, first, "publication_id", result->publication_id,
                      sizeof result->publication_id);
    copy_string_field(L, first, "manifest", result->manifest,
                      sizeof result->manifest);
  }
  if (status == WS_OK) {
    keep_string_field(L, first, "report", &agent->report);
    keep_string_field(L, first, "generation", &agent->generation);
  }
  lua_settop(L, top);
  return status;
}

const char *ws_agent_report(const ws_agent *agent) {
  return agent != NULL && agent->report != NULL ? agent->report : "";
}

const char *ws_agent_generation(const ws_agent *agent) {
  return agent != NULL && agent->generation != NULL ? agent->generation : "";
}

const char *ws_agent_error(const ws_agent *agent) {
  return agent != NULL ? agent->error : "";
}

void ws_agent_close(ws_agent *agent) {
  if (agent == NULL)
    return;
  ws_host *host = ws_host_link_get(agent->link);
  if (host == NULL) { // its host is closed: nothing left but the memory
    ws_host_link_release(agent->link);
    free(agent->report);
    free(agent->generation);
    free(agent);
    return;
  }
  if (ws_host_in_callback(host))
    return;
  lua_State *L = ws_host_lua_state(host);
  push_method(L, agent, "close");
  if (call_method_only(L, agent, 0) != WS_OK)
    fprintf(stderr, "wsync: closing an agent failed: %s\n", agent->error);
  luaL_unref(L, LUA_REGISTRYINDEX, agent->handle);
  ws_host_link_release(agent->link);
  free(agent->report);
  free(agent->generation);
  free(agent);
}
