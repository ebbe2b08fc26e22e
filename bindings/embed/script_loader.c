// The loader of wsync's Lua scripts (script_loader.h): a package.loaders entry
// whose upvalue is the script root.
#include "script_loader.h"

#include "scripts.h"

#include <lauxlib.h>

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int file_exists(const char *path) {
  struct stat info;
  return stat(path, &info) == 0 && S_ISREG(info.st_mode);
}

// Loads `name` from the directory tree at `root`: NAME.lua or NAME/init.lua,
// dots as slashes. Returns 1 with the chunk or the "not found" text pushed.
static int load_from_tree(lua_State *L, const char *root, const char *name) {
  luaL_Buffer path;
  luaL_buffinit(L, &path);
  luaL_addstring(&path, root);
  luaL_addchar(&path, '/');
  for (const char *c = name; *c; c++)
    luaL_addchar(&path, *c == '.' ? '/' : *c);
  luaL_pushresult(&path); // [..., base]
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

// package.loaders entry for "wsync" and "wsync.*": [name]; upvalue 1 is the
// script root ("" for the embedded bytecode).
static int load_wsync_module(lua_State *L) {
  const char *name = luaL_checkstring(L, 1);
  if (strcmp(name, "wsync") != 0 && strncmp(name, "wsync.", 6) != 0) {
    lua_pushstring(L, "\n\tnot a wsync module");
    return 1;
  }
  const char *root = lua_tostring(L, lua_upvalueindex(1));
  if (root[0] != '\0')
    return load_from_tree(L, root, name);
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

void ws_scripts_choose_root(char *root, size_t size) {
  root[0] = '\0';
  const char *forced = getenv("WSYNC_SCRIPTS");
  if (forced != NULL && forced[0] != '\0') {
    if (strcmp(forced, "embedded") != 0)
      snprintf(root, size, "%s", forced);
    return;
  }
#ifdef WSYNC_SOURCE_SCRIPTS
  char executable[PATH_MAX];
  ssize_t length =
      readlink("/proc/self/exe", executable, sizeof executable - 1);
  if (length <= 0)
    return;
  executable[length] = '\0';
  char *slash = strrchr(executable, '/');
  if (slash != NULL)
    *slash = '\0';
  char marker[PATH_MAX];
  snprintf(marker, sizeof marker, "%s/wsync/init.lua", WSYNC_SOURCE_SCRIPTS);
  if (strcmp(executable, WSYNC_BINARY_DIR) == 0 && file_exists(marker))
    snprintf(root, size, "%s", WSYNC_SOURCE_SCRIPTS);
#endif
}

void ws_scripts_install_loader(lua_State *L, const char *root) {
  lua_getglobal(L, "package");
  lua_getfield(L, -1, "loaders"); // [package, loaders]
  int count = (int)lua_objlen(L, -1);
  for (int i = count; i >= 2; i--) {
    lua_rawgeti(L, -1, i);
    lua_rawseti(L, -2, i + 1);
  }
  lua_pushstring(L, root);
  lua_pushcclosure(L, load_wsync_module, 1);
  lua_rawseti(L, -2, 2); // after package.preload
  lua_pop(L, 2);
}

void ws_scripts_push_embedded_names(lua_State *L) {
  lua_newtable(L);
  for (int i = 0; ws_embedded_scripts[i].name != NULL; i++) {
    lua_pushstring(L, ws_embedded_scripts[i].name);
    lua_rawseti(L, -2, i + 1);
  }
}
