// `wsync._process`: process-group signals, reaping and /proc checks.
#include "lua_util.h"
#include "modules.h"
#include "process.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>

static int check_signal(lua_State *L, int index) {
  static const char *const names[] = {"SIGTERM", "SIGKILL", "SIGINT",
                                      "SIGHUP", "SIGSTOP", "SIGCONT", NULL};
  static const int numbers[] = {SIGTERM, SIGKILL, SIGINT,
                                SIGHUP,  SIGSTOP, SIGCONT};
  return numbers[luaL_checkoption(L, index, NULL, names)];
}

static int check_group(lua_State *L, int index) {
  lua_Integer group = luaL_checkinteger(L, index);
  if (group <= 1)
    luaL_argerror(L, index, "process group must be greater than 1");
  return (int)group;
}

// _process.set_subreaper(enabled) -> true | nil, message, CODE
static int process_set_subreaper(lua_State *L) {
  luaL_checktype(L, 1, LUA_TBOOLEAN);
  return ws_lua_push_ok(L, ws_process_set_subreaper(lua_toboolean(L, 1)));
}

// _process.die_with_parent(signal, expected_parent?) -> true | nil, message,
// CODE
static int process_die_with_parent(lua_State *L) {
  int signal_number = check_signal(L, 1);
  lua_Integer parent = luaL_optinteger(L, 2, 0);
  if (parent < 0 || parent > INT32_MAX)
    luaL_argerror(L, 2, "not a process id");
  return ws_lua_push_ok(L,
                        ws_process_die_with_parent(signal_number, (int)parent));
}

// _process.signal_group(group, signal) -> true | nil, message, CODE
static int process_signal_group(lua_State *L) {
  int group = check_group(L, 1);
  return ws_lua_push_ok(L, ws_process_signal_group(group, check_signal(L, 2)));
}

// Pushes how many processes `count` (reaping or counting) finds in the group
// at argument 1, or nil, message, CODE.
static int push_group_count(lua_State *L,
                            int (*count)(int group, int *count_out)) {
  int found = 0;
  int status = count(check_group(L, 1), &found);
  return ws_lua_push_integer_result(L, status, found);
}

// _process.reap_group(group) -> reaped | nil, message, CODE
static int process_reap_group(lua_State *L) {
  return push_group_count(L, ws_process_reap_group);
}

// _process.count_group(group) -> count | nil, message, CODE
static int process_count_group(lua_State *L) {
  return push_group_count(L, ws_process_count_group);
}

// A core call that lists up to `capacity` pids (with `exited`: whether each
// waits to be reaped) and stores how many there are in `*count`.
typedef int (*list_pids_fn)(const void *query, int *pids, int *exited,
                            int capacity, int *count);

// What a listing found: `count` pids and their exited flags, in one
// allocation that freeing `pids` releases.
struct pid_list {
  int *pids;
  int *exited;
  int count;
};

// Runs `list` with room for 64 pids, and again with room for all it found
// while they did not fit. Raises (naming `what`) when out of memory.
static int list_pids(lua_State *L, const char *what, list_pids_fn list,
                     const void *query, struct pid_list *out) {
  int capacity = 64, count = 0;
  for (;;) {
    int *pids = malloc(sizeof *pids * (size_t)capacity * 2);
    if (pids == NULL)
      return luaL_error(L, "%s: out of memory", what);
    int status = list(query, pids, pids + capacity, capacity, &count);
    if (status == WS_OK && count <= capacity) {
      *out = (struct pid_list){pids, pids + capacity, count};
      return WS_OK;
    }
    free(pids);
    if (status != WS_OK)
      return status;
    capacity = count + 64; // (more were found than fit: again, larger)
  }
}

static int list_children(const void *query, int *pids, int *exited,
                         int capacity, int *count) {
  (void)query;
  return ws_process_children(pids, exited, capacity, count);
}

// _process.children() -> {{pid = pid, exited = boolean}, ...} | nil, message,
// CODE
static int process_children(lua_State *L) {
  struct pid_list children = {NULL, NULL, 0};
  int status = list_pids(L, "children", list_children, NULL, &children);
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_createtable(L, children.count, 0); // [children]
  for (int i = 0; i < children.count; i++) {
    lua_createtable(L, 0, 2); // [children, child]
    lua_pushinteger(L, children.pids[i]);
    lua_setfield(L, -2, "pid");
    lua_pushboolean(L, children.exited[i]);
    lua_setfield(L, -2, "exited");
    lua_rawseti(L, -2, i + 1); // [children]
  }
  free(children.pids);
  return 1;
}

// _process.reap(pid) -> reaped | nil, message, CODE
static int process_reap(lua_State *L) {
  lua_Integer pid = luaL_checkinteger(L, 1);
  if (pid <= 0 || pid > INT32_MAX)
    luaL_argerror(L, 1, "not a process id");
  int reaped = 0;
  int status = ws_process_reap((int)pid, &reaped);
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_pushboolean(L, reaped);
  return 1;
}

// _process.watch(pid) -> fd | nil, message, CODE
static int process_watch(lua_State *L) {
  lua_Integer pid = luaL_checkinteger(L, 1);
  if (pid <= 0 || pid > INT32_MAX)
    luaL_argerror(L, 1, "not a process id");
  int fd = -1;
  int status = ws_process_watch((int)pid, &fd);
  return ws_lua_push_integer_result(L, status, fd);
}

// The mark and sessions that find_marked looks for.
struct mark_query {
  const char *entry;
  const int *sessions;
  int session_count;
};

static int list_marked(const void *query, int *pids, int *exited, int capacity,
                       int *count) {
  const struct mark_query *mark = query;
  (void)exited;
  return ws_process_find_marked(mark->entry, mark->sessions,
                                mark->session_count, pids, capacity, count);
}

// _process.find_marked("NAME=VALUE", {session, ...}?) -> {pid, ...} | nil,
// message, CODE
static int process_find_marked(lua_State *L) {
  const char *entry = luaL_checkstring(L, 1);
  if (strchr(entry, '=') == NULL)
    luaL_argerror(L, 1, "a mark is NAME=VALUE");
  int sessions[64], session_count = 0;
  if (!lua_isnoneornil(L, 2)) {
    luaL_checktype(L, 2, LUA_TTABLE);
    session_count = (int)lua_objlen(L, 2);
    if (session_count > 64)
      luaL_argerror(L, 2, "at most 64 sessions");
    for (int i = 0; i < session_count; i++) {
      lua_rawgeti(L, 2, i + 1);
      lua_Integer session = lua_tointeger(L, -1);
      lua_pop(L, 1);
      if (session <= 1 || session > INT32_MAX)
        luaL_argerror(L, 2, "a session is a process id above 1");
      sessions[i] = (int)session;
    }
  }
  struct mark_query query = {entry, sessions, session_count};
  struct pid_list marked = {NULL, NULL, 0};
  int status = list_pids(L, "find_marked", list_marked, &query, &marked);
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_createtable(L, marked.count, 0); // [pids]
  for (int i = 0; i < marked.count; i++) {
    lua_pushinteger(L, marked.pids[i]);
    lua_rawseti(L, -2, i + 1);
  }
  free(marked.pids);
  return 1;
}

int luaopen_wsync_process(lua_State *L) {
  static const luaL_Reg functions[] = {
      {"set_subreaper", process_set_subreaper},
      {"die_with_parent", process_die_with_parent},
      {"signal_group", process_signal_group},
      {"reap_group", process_reap_group},
      {"count_group", process_count_group},
      {"children", process_children},
      {"reap", process_reap},
      {"watch", process_watch},
      {"find_marked", process_find_marked},
      {NULL, NULL},
  };
  return ws_lua_new_module(L, functions);
}
