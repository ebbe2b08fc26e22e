// Where a host's `require("wsync...")` finds wsync's Lua scripts: the source
// tree in development, the bytecode embedded in the build otherwise.
#pragma once

#include <lua.h>
#include <stddef.h>

/// Chooses where wsync's Lua scripts come from and writes the directory into
/// `root` ("" for the embedded bytecode): $WSYNC_SCRIPTS ("embedded" forces
/// the bytecode), else the source tree when the running executable lies in
/// the build tree, else the bytecode.
void ws_scripts_choose_root(char *root, size_t size);

/// Installs the package.loaders entry for "wsync" and "wsync.*", right after
/// package.preload, loading from `root` (copied) or, when it is "", from the
/// embedded bytecode.
void ws_scripts_install_loader(lua_State *L, const char *root);

/// Pushes the names of the embedded modules as an array.
void ws_scripts_push_embedded_names(lua_State *L);
