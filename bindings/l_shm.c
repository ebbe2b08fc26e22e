// `wsync._shm`: shared-memory buffers of the host backend.
#include "lua_util.h"
#include "modules.h"
#include "digest.h"
#include "shm.h"

#include <string.h>

static const char shm_class[] = "wsync.shm";

// Checks that [offset, offset + length) lies inside the buffer and that both
// are integers. Written so that NaN fails the first test.
static void check_range(lua_State *L, ws_shm *shm, lua_Number offset,
                        lua_Number length) {
  lua_Number size = (lua_Number)ws_shm_size(shm);
  if (!(offset >= 0 && length >= 0 && offset + length <= size) ||
      offset != (lua_Number)(size_t)offset ||
      length != (lua_Number)(size_t)length)
    luaL_error(L, "range [%f, %f) is outside the %f-byte buffer", offset,
               offset + length, size);
}

// Pushes a new buffer of the size at argument 1, made by `create`: the buffer
// or nil, message, CODE.
static int push_created(lua_State *L,
                        int (*create)(size_t size, ws_shm **out)) {
  lua_Number size = luaL_checknumber(L, 1);
  if (size < 1 || size != (lua_Number)(size_t)size)
    luaL_argerror(L, 1, "size must be a positive integer");
  ws_lua_push_box(L, shm_class, NULL); // first: its allocation may raise
  ws_shm *shm = NULL;
  int status = create((size_t)size, &shm);
  return ws_lua_fill_box(L, status, shm);
}

// _shm.create(bytes) -> buffer | nil, message, CODE
static int shm_create(lua_State *L) { return push_created(L, ws_shm_create); }

// _shm.anonymous(bytes) -> buffer | nil, message, CODE (private memory)
static int shm_anonymous(lua_State *L) {
  return push_created(L, ws_shm_create_anonymous);
}

static size_t check_size(lua_State *L, int index) {
  lua_Number value = luaL_checknumber(L, index);
  if (value < 0 || value != (lua_Number)(size_t)value)
    luaL_argerror(L, index, "expected a non-negative integer");
  return (size_t)value;
}

// buffer:copy_from(source, source_offset, offset, length)
//   -> true | nil, message, CODE
static int shm_copy_from(lua_State *L) {
  ws_shm *target = ws_lua_check_box(L, 1, shm_class);
  ws_shm *source = ws_lua_check_box(L, 2, shm_class);
  return ws_lua_push_ok(L, ws_shm_copy(target, check_size(L, 4), source,
                                       check_size(L, 3), check_size(L, 5)));
}

// buffer:sha256([offset, length]) -> hex | nil, message, CODE
static int shm_sha256(lua_State *L) {
  ws_shm *shm = ws_lua_check_box(L, 1, shm_class);
  size_t offset = lua_isnoneornil(L, 2) ? 0 : check_size(L, 2);
  size_t length = lua_isnoneornil(L, 3) ? ws_shm_size(shm) - offset
                                        : check_size(L, 3);
  char hex[WS_SHA256_HEX_LENGTH + 1];
  int status = ws_shm_sha256(shm, offset, length, hex);
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_pushlstring(L, hex, WS_SHA256_HEX_LENGTH);
  return 1;
}

// _shm.open(name) -> buffer | nil, message, CODE
static int shm_open_existing(lua_State *L) {
  const char *name = luaL_checkstring(L, 1);
  ws_lua_push_box(L, shm_class, NULL); // first: its allocation may raise
  ws_shm *shm = NULL;
  int status = ws_shm_open(name, &shm);
  return ws_lua_fill_box(L, status, shm);
}

// buffer:name() -> "/wsync-..."
static int shm_name(lua_State *L) {
  lua_pushstring(L, ws_shm_name(ws_lua_check_box(L, 1, shm_class)));
  return 1;
}

// buffer:size() -> bytes
static int shm_size(lua_State *L) {
  lua_pushnumber(L, (lua_Number)ws_shm_size(ws_lua_check_box(L, 1, shm_class)));
  return 1;
}

// buffer:is_owner() -> boolean
static int shm_is_owner(lua_State *L) {
  lua_pushboolean(L, ws_shm_is_owner(ws_lua_check_box(L, 1, shm_class)));
  return 1;
}

// buffer:pointer() -> lightuserdata to the mapped bytes (for ffi.cast)
static int shm_pointer(lua_State *L) {
  lua_pushlightuserdata(L, ws_shm_data(ws_lua_check_box(L, 1, shm_class)));
  return 1;
}

// buffer:write(offset, bytes)
static int shm_write(lua_State *L) {
  ws_shm *shm = ws_lua_check_box(L, 1, shm_class);
  lua_Number offset = luaL_checknumber(L, 2);
  size_t length = 0;
  const char *bytes = luaL_checklstring(L, 3, &length);
  check_range(L, shm, offset, (lua_Number)length);
  memcpy((char *)ws_shm_data(shm) + (size_t)offset, bytes, length);
  return 0;
}

// buffer:read(offset, length) -> bytes
static int shm_read(lua_State *L) {
  ws_shm *shm = ws_lua_check_box(L, 1, shm_class);
  lua_Number offset = luaL_checknumber(L, 2);
  lua_Number length = luaL_checknumber(L, 3);
  check_range(L, shm, offset, length);
  lua_pushlstring(L, (const char *)ws_shm_data(shm) + (size_t)offset,
                  (size_t)length);
  return 1;
}

// buffer:unlink() -> true | nil, message, CODE
static int shm_unlink_name(lua_State *L) {
  return ws_lua_push_ok(L, ws_shm_unlink(ws_lua_check_box(L, 1, shm_class)));
}

// buffer:close(): unmaps, and unlinks when owner.
static int close_shm(void *shm) { return ws_shm_close(shm); }

static void describe_shm(lua_State *L, void *shm) {
  lua_pushfstring(L, "%s (%f bytes)", ws_shm_name(shm),
                  (lua_Number)ws_shm_size(shm));
}

int luaopen_wsync_shm(lua_State *L) {
  static const ws_lua_class buffers = {shm_class, "close", close_shm, NULL,
                                       describe_shm};
  static const luaL_Reg methods[] = {
      {"name", shm_name},         {"size", shm_size},
      {"is_owner", shm_is_owner}, {"pointer", shm_pointer},
      {"write", shm_write},       {"read", shm_read},
      {"unlink", shm_unlink_name}, {"copy_from", shm_copy_from},
      {"sha256", shm_sha256},     {NULL, NULL},
  };
  static const luaL_Reg functions[] = {
      {"create", shm_create},
      {"open", shm_open_existing},
      {"anonymous", shm_anonymous},
      {NULL, NULL},
  };
  ws_lua_new_class(L, &buffers, methods);
  return ws_lua_new_module(L, functions);
}
