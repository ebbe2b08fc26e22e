// `wsync._manifest`: streaming manifests over structural tensor records.
#include "lua_util.h"
#include "modules.h"
#include "manifest.h"

static const char manifest_class[] = "wsync.manifest";
static const char segment_class[] = "wsync.manifest_segment";

static ws_dtype check_dtype(lua_State *L, int index) {
  size_t length = 0;
  const char *name = luaL_checklstring(L, index, &length);
  ws_dtype dtype = ws_dtype_from_name(name, length);
  if (dtype == WS_DTYPE_COUNT)
    luaL_argerror(L, index, lua_pushfstring(L, "unknown dtype '%s'", name));
  return dtype;
}

static int check_shape(lua_State *L, int index, int64_t *shape) {
  luaL_checktype(L, index, LUA_TTABLE);
  int dims = (int)lua_objlen(L, index);
  if (dims > WS_MANIFEST_MAX_DIMS)
    luaL_argerror(L, index,
                  lua_pushfstring(L, "shape has %d dimensions, at most %d",
                                  dims, WS_MANIFEST_MAX_DIMS));
  for (int i = 0; i < dims; i++) {
    lua_rawgeti(L, index, i + 1);
    if (!lua_isnumber(L, -1))
      luaL_argerror(L, index,
                    lua_pushfstring(L, "shape[%d] is not a number", i + 1));
    lua_Number value = lua_tonumber(L, -1);
    shape[i] = (int64_t)value;
    if ((lua_Number)shape[i] != value)
      luaL_argerror(L, index,
                    lua_pushfstring(L, "shape[%d] is not an integer", i + 1));
    lua_pop(L, 1);
  }
  return dims;
}

// A record's arguments (name, dtype, shape at 2, 3 and 4) as the core takes
// them.
struct record {
  const char *name;
  size_t name_length;
  ws_dtype dtype;
  int64_t shape[WS_MANIFEST_MAX_DIMS];
  int dims;
};

static void check_record(lua_State *L, struct record *out) {
  out->name = luaL_checklstring(L, 2, &out->name_length);
  out->dtype = check_dtype(L, 3);
  out->dims = check_shape(L, 4, out->shape);
}

// Returns the object at 1 (calls chain) when `status` is WS_OK; nil,
// message, CODE otherwise.
static int push_self_or_failure(lua_State *L, int status) {
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_settop(L, 1);
  return 1;
}

// _manifest.new() -> manifest | nil, message, CODE
static int manifest_new(lua_State *L) {
  ws_lua_push_box(L, manifest_class, NULL); // first: its allocation may raise
  ws_manifest *manifest = NULL;
  int status = ws_manifest_new(&manifest);
  return ws_lua_fill_box(L, status, manifest);
}

// manifest:add(name, dtype, shape) -> manifest | nil, message, CODE
static int manifest_add(lua_State *L) {
  ws_manifest *manifest = ws_lua_check_box(L, 1, manifest_class);
  struct record record;
  check_record(L, &record);
  return push_self_or_failure(
      L, ws_manifest_add(manifest, record.name, record.name_length,
                         record.dtype, record.shape, record.dims));
}

// manifest:finish() -> hex digest | nil, message, CODE
static int manifest_finish(lua_State *L) {
  ws_manifest *manifest = ws_lua_check_box(L, 1, manifest_class);
  char hex[WS_MANIFEST_HEX_LENGTH + 1];
  int status = ws_manifest_finish(manifest, hex);
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_pushlstring(L, hex, WS_MANIFEST_HEX_LENGTH);
  return 1;
}

// manifest:count() -> records added
static int manifest_count(lua_State *L) {
  ws_manifest *manifest = ws_lua_check_box(L, 1, manifest_class);
  lua_pushnumber(L, (lua_Number)ws_manifest_count(manifest));
  return 1;
}

// manifest:bytes() -> sum of the records' byte counts
static int manifest_bytes(lua_State *L) {
  ws_manifest *manifest = ws_lua_check_box(L, 1, manifest_class);
  lua_pushnumber(L, (lua_Number)ws_manifest_bytes(manifest));
  return 1;
}

// manifest:close() (no results); __gc frees the same way.
static int manifest_close(lua_State *L) {
  ws_manifest_free(ws_lua_take_box(L, 1, manifest_class));
  return 0;
}

static int free_manifest(void *manifest) {
  ws_manifest_free(manifest);
  return WS_OK;
}

static void describe_manifest(lua_State *L, void *manifest) {
  lua_pushfstring(L, "(%d records)", (int)ws_manifest_count(manifest));
}

// _manifest.segment() -> segment | nil, message, CODE
static int segment_new(lua_State *L) {
  ws_lua_push_box(L, segment_class, NULL); // first: its allocation may raise
  ws_manifest_segment *segment = NULL;
  int status = ws_manifest_segment_new(&segment);
  return ws_lua_fill_box(L, status, segment);
}

// segment:add(name, dtype, shape) -> segment | nil, message, CODE
static int segment_add(lua_State *L) {
  ws_manifest_segment *segment = ws_lua_check_box(L, 1, segment_class);
  struct record record;
  check_record(L, &record);
  return push_self_or_failure(
      L, ws_manifest_segment_add(segment, record.name, record.name_length,
                                 record.dtype, record.shape, record.dims));
}

// segment:count() -> records in the segment
static int segment_count(lua_State *L) {
  ws_manifest_segment *segment = ws_lua_check_box(L, 1, segment_class);
  lua_pushnumber(L, (lua_Number)ws_manifest_segment_count(segment));
  return 1;
}

// segment:close() (no results); __gc frees the same way.
static int segment_close(lua_State *L) {
  ws_manifest_segment_free(ws_lua_take_box(L, 1, segment_class));
  return 0;
}

static int free_segment(void *segment) {
  ws_manifest_segment_free(segment);
  return WS_OK;
}

static void describe_segment(lua_State *L, void *segment) {
  lua_pushfstring(L, "(%d records)", (int)ws_manifest_segment_count(segment));
}

// manifest:add_segment(segment) -> manifest | nil, message, CODE
static int manifest_add_segment(lua_State *L) {
  ws_manifest *manifest = ws_lua_check_box(L, 1, manifest_class);
  ws_manifest_segment *segment = ws_lua_check_box(L, 2, segment_class);
  return push_self_or_failure(L, ws_manifest_add_segment(manifest, segment));
}

int luaopen_wsync_manifest(lua_State *L) {
  static const ws_lua_class manifests = {manifest_class, NULL, free_manifest,
                                         NULL, describe_manifest};
  static const ws_lua_class segments = {segment_class, NULL, free_segment,
                                        NULL, describe_segment};
  static const luaL_Reg methods[] = {
      {"add", manifest_add},       {"finish", manifest_finish},
      {"count", manifest_count},   {"bytes", manifest_bytes},
      {"close", manifest_close},   {"add_segment", manifest_add_segment},
      {NULL, NULL},
  };
  static const luaL_Reg segment_methods[] = {
      {"add", segment_add},
      {"count", segment_count},
      {"close", segment_close},
      {NULL, NULL},
  };
  static const luaL_Reg functions[] = {
      {"new", manifest_new},
      {"segment", segment_new},
      {NULL, NULL},
  };
  ws_lua_new_class(L, &manifests, methods);
  ws_lua_new_class(L, &segments, segment_methods);
  return ws_lua_new_module(L, functions);
}
