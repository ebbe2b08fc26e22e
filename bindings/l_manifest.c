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

// Returns the object at 1 (calls chain) when `status` is WS_OK; nil,
// message, CODE otherwise.
static int push_self_or_failure(lua_State *L, int status) {
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_settop(L, 1);
  return 1;
}

// A class whose objects take records one by one (manifests, segments): the
// core's functions that the shared methods call.
typedef struct records_class {
  ws_lua_class base; // first: what ws_lua_class_of answers is this class
  int (*add)(void *records, const char *name, size_t name_length,
             ws_dtype dtype, const int64_t *shape, int dims);
  uint64_t (*count)(const void *records);
} records_class;

// manifest:add(name, dtype, shape), segment:add(...) -> self | nil, message,
// CODE
static int records_add(lua_State *L) {
  const records_class *class = (const records_class *)ws_lua_class_of(L);
  void *records = ws_lua_check_box(L, 1, class->base.name);
  size_t name_length = 0;
  const char *name = luaL_checklstring(L, 2, &name_length);
  ws_dtype dtype = check_dtype(L, 3);
  int64_t shape[WS_MANIFEST_MAX_DIMS];
  int dims = check_shape(L, 4, shape);
  return push_self_or_failure(
      L, class->add(records, name, name_length, dtype, shape, dims));
}

// manifest:count(), segment:count() -> records added
static int records_count(lua_State *L) {
  const records_class *class = (const records_class *)ws_lua_class_of(L);
  void *records = ws_lua_check_box(L, 1, class->base.name);
  lua_pushnumber(L, (lua_Number)class->count(records));
  return 1;
}

// manifest:close(), segment:close() (no results); __gc frees the same way.
static int records_close(lua_State *L) {
  const ws_lua_class *class = ws_lua_class_of(L);
  class->release(ws_lua_take_box(L, 1, class->name));
  return 0;
}

// "(COUNT records)", after a manifest's or a segment's class name.
static void describe_records(lua_State *L, void *records) {
  const records_class *class = (const records_class *)ws_lua_class_of(L);
  lua_pushfstring(L, "(%d records)", (int)class->count(records));
}

// The core's manifest and segment functions, typed for records_class.
static int free_manifest(void *manifest) {
  ws_manifest_free(manifest);
  return WS_OK;
}
static int free_segment(void *segment) {
  ws_manifest_segment_free(segment);
  return WS_OK;
}
static int add_to_manifest(void *manifest, const char *name,
                           size_t name_length, ws_dtype dtype,
                           const int64_t *shape, int dims) {
  return ws_manifest_add(manifest, name, name_length, dtype, shape, dims);
}
static int add_to_segment(void *segment, const char *name, size_t name_length,
                          ws_dtype dtype, const int64_t *shape, int dims) {
  return ws_manifest_segment_add(segment, name, name_length, dtype, shape,
                                 dims);
}
static uint64_t manifest_records(const void *manifest) {
  return ws_manifest_count(manifest);
}
static uint64_t segment_records(const void *segment) {
  return ws_manifest_segment_count(segment);
}

static const records_class manifests = {
    {manifest_class, NULL, free_manifest, NULL, describe_records},
    add_to_manifest, manifest_records};
static const records_class segments = {
    {segment_class, NULL, free_segment, NULL, describe_records},
    add_to_segment, segment_records};

// _manifest.new() -> manifest | nil, message, CODE
static int manifest_new(lua_State *L) {
  ws_lua_push_box(L, manifest_class, NULL); // first: its allocation may raise
  ws_manifest *manifest = NULL;
  int status = ws_manifest_new(&manifest);
  return ws_lua_fill_box(L, status, manifest);
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

// manifest:bytes() -> sum of the records' byte counts
static int manifest_bytes(lua_State *L) {
  ws_manifest *manifest = ws_lua_check_box(L, 1, manifest_class);
  lua_pushnumber(L, (lua_Number)ws_manifest_bytes(manifest));
  return 1;
}

// manifest:add_segment(segment) -> manifest | nil, message, CODE
static int manifest_add_segment(lua_State *L) {
  ws_manifest *manifest = ws_lua_check_box(L, 1, manifest_class);
  ws_manifest_segment *segment = ws_lua_check_box(L, 2, segment_class);
  return push_self_or_failure(L, ws_manifest_add_segment(manifest, segment));
}

// _manifest.segment() -> segment | nil, message, CODE
static int segment_new(lua_State *L) {
  ws_lua_push_box(L, segment_class, NULL); // first: its allocation may raise
  ws_manifest_segment *segment = NULL;
  int status = ws_manifest_segment_new(&segment);
  return ws_lua_fill_box(L, status, segment);
}

int luaopen_wsync_manifest(lua_State *L) {
  static const luaL_Reg methods[] = {
      {"add", records_add},      {"finish", manifest_finish},
      {"count", records_count},  {"bytes", manifest_bytes},
      {"close", records_close},  {"add_segment", manifest_add_segment},
      {NULL, NULL},
  };
  static const luaL_Reg segment_methods[] = {
      {"add", records_add},
      {"count", records_count},
      {"close", records_close},
      {NULL, NULL},
  };
  static const luaL_Reg functions[] = {
      {"new", manifest_new},
      {"segment", segment_new},
      {NULL, NULL},
  };
  ws_lua_new_class(L, &manifests.base, methods);
  ws_lua_new_class(L, &segments.base, segment_methods);
  return ws_lua_new_module(L, functions);
}
