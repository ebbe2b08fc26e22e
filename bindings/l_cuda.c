// `wsync._cuda`: device buffers, IPC mappings, streams, events, copy plans,
// synthetic plans and FP8 plans of the cuda backend (host/cuda_memory.h,
// host/cuda_plan.h).
#include "l_cuda.h"

#include "cuda_plan.h"
#include "device.h"
#include "dtype.h"
#include "synth.h"

#include <math.h>
#include <string.h>

static const char buffer_class[] = "wsync.cuda.buffer";
static const char mapping_class[] = "wsync.cuda.mapping";
static const char stream_class[] = "wsync.cuda.stream";
static const char event_class[] = "wsync.cuda.event";
static const char copy_plan_class[] = "wsync.cuda.copy_plan";
static const char synth_plan_class[] = "wsync.cuda.synth_plan";
static const char fp8_plan_class[] = "wsync.cuda.fp8_plan";

static const lua_Number exact_limit = 9007199254740992.0; // 2^53

static int is_count(lua_Number value) {
  return value >= 0 && value <= exact_limit && value == floor(value);
}

uint64_t ws_lua_check_count(lua_State *L, int index) {
  lua_Number value = luaL_checknumber(L, index);
  if (!is_count(value))
    luaL_argerror(L, index, "expected a non-negative integer below 2^53");
  return (uint64_t)value;
}

static int check_device(lua_State *L, int index) {
  lua_Integer device = luaL_checkinteger(L, index);
  if (device < 0 || device > 1 << 20)
    luaL_argerror(L, index, "expected a device index");
  return (int)device;
}

uint64_t ws_lua_op_field(lua_State *L, int table, size_t position,
                         const char *name, int required, uint64_t fallback) {
  lua_getfield(L, table, name); // [..., value]
  uint64_t result = fallback;
  if (lua_isnil(L, -1)) {
    if (required)
      luaL_error(L, "op %d: field %s is missing", (int)position, name);
  } else if (lua_type(L, -1) != LUA_TNUMBER || !is_count(lua_tonumber(L, -1))) {
    luaL_error(L, "op %d: field %s must be a non-negative integer below 2^53",
               (int)position, name);
  } else {
    result = (uint64_t)lua_tonumber(L, -1);
  }
  lua_pop(L, 1);
  return result;
}

// Reads table field `name` of a region table as a count.
static uint64_t region_field(lua_State *L, int index, const char *name) {
  lua_getfield(L, index, name);
  if (lua_type(L, -1) != LUA_TNUMBER || !is_count(lua_tonumber(L, -1))) {
    const char *message = lua_pushfstring(
        L, "region field %s must be a non-negative integer below 2^53", name);
    luaL_argerror(L, index, message);
  }
  uint64_t value = (uint64_t)lua_tonumber(L, -1);
  lua_pop(L, 1);
  return value;
}

// A class whose objects are regions (buffers, mappings): how to read one.
typedef struct region_class {
  ws_lua_class base; // first: what ws_lua_class_of answers is this class
  void (*region)(const void *object, ws_cuda_region *out);
} region_class;

// "BYTES bytes on device INDEX", after a buffer's or a mapping's class name.
static void describe_region(lua_State *L, void *object) {
  ws_cuda_region region;
  ((const region_class *)ws_lua_class_of(L))->region(object, &region);
  lua_pushfstring(L, "%f bytes on device %d", (lua_Number)region.size,
                  (int)region.device);
}

// The core's buffer and mapping functions, typed for region_class.
static int close_buffer(void *buffer) { return ws_cuda_buffer_close(buffer); }
static int close_mapping(void *mapping) {
  return ws_cuda_mapping_close(mapping);
}
static void buffer_region(const void *buffer, ws_cuda_region *out) {
  ws_cuda_buffer_region(buffer, out);
}
static void mapping_region(const void *mapping, ws_cuda_region *out) {
  ws_cuda_mapping_region(mapping, out);
}

static const region_class buffers = {
    {buffer_class, "close", close_buffer, NULL, describe_region},
    buffer_region};
static const region_class mappings = {
    {mapping_class, "close", close_mapping, NULL, describe_region},
    mapping_region};

void ws_lua_check_cuda_region(lua_State *L, int index, ws_cuda_region *out) {
  const region_class *classes[] = {&buffers, &mappings};
  for (size_t i = 0; i < sizeof classes / sizeof classes[0]; i++) {
    void **box = luaL_testudata(L, index, classes[i]->base.name);
    if (box == NULL)
      continue;
    if (*box == NULL)
      luaL_argerror(L, index,
                    lua_pushfstring(L, "%s is closed", classes[i]->base.name));
    classes[i]->region(*box, out);
    return;
  }
  if (lua_type(L, index) != LUA_TTABLE) {
    const char *message = lua_pushfstring(
        L, "region expected (a cuda buffer, a mapping or {pointer, size, "
           "device}), got %s",
        luaL_typename(L, index));
    luaL_argerror(L, index, message);
  }
  out->pointer = region_field(L, index, "pointer");
  out->size = region_field(L, index, "size");
  out->device = (int32_t)region_field(L, index, "device");
  out->reserved = 0;
}

void ws_lua_check_region_copy(lua_State *L, int index,
                              ws_lua_region_copy *out) {
  ws_lua_check_cuda_region(L, index, &out->target);
  out->target_offset = ws_lua_check_count(L, index + 1);
  ws_lua_check_cuda_region(L, index + 2, &out->source);
  out->source_offset = ws_lua_check_count(L, index + 3);
  out->bytes = ws_lua_check_count(L, index + 4);
}

ws_cuda_region *ws_lua_check_cuda_regions(lua_State *L, int index,
                                          size_t *count) {
  luaL_checktype(L, index, LUA_TTABLE);
  size_t length = lua_objlen(L, index);
  ws_cuda_region *regions =
      lua_newuserdata(L, (length > 0 ? length : 1) * sizeof *regions);
  // [..., scratch]
  int top = lua_gettop(L);
  for (size_t i = 0; i < length; i++) {
    lua_rawgeti(L, index, (int)i + 1); // [..., scratch, region]
    ws_lua_check_cuda_region(L, top + 1, &regions[i]);
    lua_settop(L, top);
  }
  *count = length;
  return regions;
}

ws_cuda_stream *ws_lua_opt_cuda_stream(lua_State *L, int index) {
  if (lua_isnoneornil(L, index))
    return NULL;
  return ws_lua_check_box(L, index, stream_class);
}

void *ws_lua_check_ops(lua_State *L, int index, size_t record_size,
                       void (*convert)(lua_State *L, int table, size_t position,
                                       void *record),
                       size_t *count) {
  if (lua_type(L, index) == LUA_TSTRING) {
    size_t length = 0;
    const char *bytes = lua_tolstring(L, index, &length);
    if (length % record_size != 0)
      luaL_argerror(L, index, "packed ops: length is not a whole number of "
                              "records");
    void *records = lua_newuserdata(L, length > 0 ? length : 1);
    memcpy(records, bytes, length);
    *count = length / record_size;
    return records;
  }
  luaL_checktype(L, index, LUA_TTABLE);
  size_t length = lua_objlen(L, index);
  char *records = lua_newuserdata(L, (length > 0 ? length : 1) * record_size);
  memset(records, 0, (length > 0 ? length : 1) * record_size);
  int top = lua_gettop(L); // [..., scratch]
  for (size_t i = 0; i < length; i++) {
    lua_rawgeti(L, index, (int)i + 1); // [..., scratch, op]
    if (!lua_istable(L, -1))
      luaL_error(L, "op %d: expected a table, got %s", (int)i + 1,
                 luaL_typename(L, -1));
    convert(L, top + 1, i + 1, records + i * record_size);
    lua_settop(L, top);
  }
  *count = length;
  return records;
}

// Keeps the values at `from` .. `to` referenced from the userdata on top
// (its environment table), so that the collector does not free memory a
// plan's descriptors point into while the plan lives.
static void keep_referenced(lua_State *L, int from, int to) {
  lua_createtable(L, to - from + 1, 0); // [..., box, keep]
  for (int i = from; i <= to; i++) {
    lua_pushvalue(L, i);
    lua_rawseti(L, -2, i - from + 1);
  }
  lua_setfenv(L, -2); // [..., box]
}

// ---------------------------------------------------------------------------
// Regions: functions that take any region (methods of buffers and mappings)

// region:region() -> {pointer, size, device}
static int region_table(lua_State *L) {
  ws_cuda_region region;
  ws_lua_check_cuda_region(L, 1, &region);
  lua_createtable(L, 0, 3);
  ws_lua_set_number(L, "pointer", region.pointer);
  ws_lua_set_number(L, "size", region.size);
  lua_pushinteger(L, region.device);
  lua_setfield(L, -2, "device");
  return 1;
}

// region:pointer() -> device address (a number)
static int region_pointer(lua_State *L) {
  ws_cuda_region region;
  ws_lua_check_cuda_region(L, 1, &region);
  lua_pushnumber(L, (lua_Number)region.pointer);
  return 1;
}

// region:size() -> bytes
static int region_size(lua_State *L) {
  ws_cuda_region region;
  ws_lua_check_cuda_region(L, 1, &region);
  lua_pushnumber(L, (lua_Number)region.size);
  return 1;
}

// region:device() -> index
static int region_device(lua_State *L) {
  ws_cuda_region region;
  ws_lua_check_cuda_region(L, 1, &region);
  lua_pushinteger(L, region.device);
  return 1;
}

// _cuda.write(region, offset, bytes[, stream]) -> true | nil, message, CODE
static int cuda_write(lua_State *L) {
  ws_cuda_region region;
  ws_lua_check_cuda_region(L, 1, &region);
  uint64_t offset = ws_lua_check_count(L, 2);
  size_t length = 0;
  const char *bytes = luaL_checklstring(L, 3, &length);
  ws_cuda_stream *stream = ws_lua_opt_cuda_stream(L, 4);
  return ws_lua_push_ok(
      L, ws_cuda_write(&region, offset, bytes, length, stream));
}

// _cuda.read(region, offset, length[, stream]) -> bytes | nil, message, CODE
static int cuda_read(lua_State *L) {
  ws_cuda_region region;
  ws_lua_check_cuda_region(L, 1, &region);
  uint64_t offset = ws_lua_check_count(L, 2);
  uint64_t length = ws_lua_check_count(L, 3);
  ws_cuda_stream *stream = ws_lua_opt_cuda_stream(L, 4);
  if (offset > region.size || length > region.size - offset)
    luaL_argerror(L, 3, "range exceeds the region");
  // Scratch the collector owns: a failure below leaks nothing.
  void *bytes = lua_newuserdata(L, length > 0 ? (size_t)length : 1);
  int status = ws_cuda_read(&region, offset, bytes, (size_t)length, stream);
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_pushlstring(L, bytes, (size_t)length);
  return 1;
}

// _cuda.fill(region, offset, length, byte[, stream]) -> true | nil, message,
// CODE (queued on the stream)
static int cuda_fill(lua_State *L) {
  ws_cuda_region region;
  ws_lua_check_cuda_region(L, 1, &region);
  uint64_t offset = ws_lua_check_count(L, 2);
  uint64_t length = ws_lua_check_count(L, 3);
  lua_Integer value = luaL_checkinteger(L, 4);
  if (value < 0 || value > 255)
    luaL_argerror(L, 4, "expected a byte value 0..255");
  ws_cuda_stream *stream = ws_lua_opt_cuda_stream(L, 5);
  return ws_lua_push_ok(
      L, ws_cuda_memset(&region, offset, length, (int)value, stream));
}

// _cuda.memcpy(target, target_offset, source, source_offset, length[,
// stream]) -> true | nil, message, CODE (one cudaMemcpyAsync, queued)
static int cuda_memcpy(lua_State *L) {
  ws_lua_region_copy copy;
  ws_lua_check_region_copy(L, 1, &copy);
  ws_cuda_stream *stream = ws_lua_opt_cuda_stream(L, 6);
  return ws_lua_push_ok(
      L, ws_cuda_memcpy(&copy.target, copy.target_offset, &copy.source,
                        copy.source_offset, copy.bytes, stream));
}

// ---------------------------------------------------------------------------
// Buffers

// _cuda.buffer(device, bytes) -> buffer | nil, message, CODE
static int cuda_buffer(lua_State *L) {
  int device = check_device(L, 1);
  lua_Number size = luaL_checknumber(L, 2);
  if (!(size >= 1 && is_count(size)))
    luaL_argerror(L, 2, "size must be a positive integer");
  ws_lua_push_box(L, buffer_class, NULL); // first: its allocation may raise
  ws_cuda_buffer *buffer = NULL;
  int status = ws_cuda_buffer_create(device, (size_t)size, &buffer);
  return ws_lua_fill_box(L, status, buffer);
}

// buffer:export() -> 64-byte cudaIpcMemHandle_t | nil, message, CODE
static int buffer_export(lua_State *L) {
  ws_cuda_buffer *buffer = ws_lua_check_box(L, 1, buffer_class);
  unsigned char handle[WS_CUDA_IPC_HANDLE_BYTES];
  int status = ws_cuda_buffer_export(buffer, handle);
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_pushlstring(L, (const char *)handle, sizeof handle);
  return 1;
}

// _cuda.export_region(region) -> handle, allocation_size, offset | nil,
// message, CODE: the cudaMalloc allocation that holds memory this process
// allocated some other way (a torch tensor's storage), exported.
static int cuda_export_region(lua_State *L) {
  ws_cuda_region region;
  ws_lua_check_cuda_region(L, 1, &region);
  unsigned char handle[WS_CUDA_IPC_HANDLE_BYTES];
  uint64_t allocation_size = 0, offset = 0;
  int status =
      ws_cuda_export_region(&region, handle, &allocation_size, &offset);
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_pushlstring(L, (const char *)handle, sizeof handle);
  lua_pushnumber(L, (lua_Number)allocation_size);
  lua_pushnumber(L, (lua_Number)offset);
  return 3;
}

// ---------------------------------------------------------------------------
// Mappings

// _cuda.import(device, handle, bytes) -> mapping | nil, message, CODE
static int cuda_import(lua_State *L) {
  int device = check_device(L, 1);
  size_t length = 0;
  const char *handle = luaL_checklstring(L, 2, &length);
  if (length != WS_CUDA_IPC_HANDLE_BYTES)
    luaL_argerror(L, 2, "expected a 64-byte cudaIpcMemHandle_t");
  lua_Number size = luaL_checknumber(L, 3);
  if (!(size >= 1 && is_count(size)))
    luaL_argerror(L, 3, "size must be a positive integer");
  ws_lua_push_box(L, mapping_class, NULL);
  ws_cuda_mapping *mapping = NULL;
  int status = ws_cuda_mapping_open(device, (const unsigned char *)handle,
                                    (size_t)size, &mapping);
  return ws_lua_fill_box(L, status, mapping);
}

// ---------------------------------------------------------------------------
// Streams and events

// _cuda.stream(device) -> stream | nil, message, CODE
static int cuda_stream(lua_State *L) {
  int device = check_device(L, 1);
  ws_lua_push_box(L, stream_class, NULL);
  ws_cuda_stream *stream = NULL;
  int status = ws_cuda_stream_create(device, &stream);
  return ws_lua_fill_box(L, status, stream);
}

// stream:synchronize() -> true | nil, message, CODE (blocks, no spinning)
static int stream_synchronize(lua_State *L) {
  return ws_lua_push_ok(
      L, ws_cuda_stream_synchronize(ws_lua_check_box(L, 1, stream_class)));
}

// A 32-bit word's value: a whole number in [0, 2^32).
static uint32_t check_word(lua_State *L, int index) {
  lua_Number value = luaL_checknumber(L, index);
  if (value < 0 || value > 4294967295.0 || value != (lua_Number)(uint32_t)value)
    luaL_argerror(L, index, "a 32-bit word's value is a whole number in [0, 2^32)");
  return (uint32_t)value;
}

// Queues `operation` (a wait for or a write of a word) on the stream at 1 for
// the word at (region 2, offset 3) and the value at 4: true | nil, message,
// CODE.
static int queue_word(lua_State *L,
                      int (*operation)(ws_cuda_stream *stream,
                                       const ws_cuda_region *region,
                                       uint64_t offset, uint32_t value)) {
  ws_cuda_stream *stream = ws_lua_check_box(L, 1, stream_class);
  ws_cuda_region region;
  ws_lua_check_cuda_region(L, 2, &region);
  uint64_t offset = ws_lua_check_count(L, 3);
  uint32_t value = check_word(L, 4);
  return ws_lua_push_ok(L, operation(stream, &region, offset, value));
}

// stream:wait_value(region, offset, value) -> true | nil, message, CODE
// (queued: the device waits until the word reaches `value`, cyclically)
static int stream_wait_value(lua_State *L) {
  return queue_word(L, ws_cuda_stream_wait_value);
}

// stream:write_value(region, offset, value) -> true | nil, message, CODE
// (queued: written once the work before it finished)
static int stream_write_value(lua_State *L) {
  return queue_word(L, ws_cuda_stream_write_value);
}

// stream:device() -> index
static int stream_device(lua_State *L) {
  lua_pushinteger(L,
                  ws_cuda_stream_device(ws_lua_check_box(L, 1, stream_class)));
  return 1;
}

static int destroy_stream(void *stream) {
  return ws_cuda_stream_destroy(stream);
}

static void describe_stream(lua_State *L, void *stream) {
  lua_pushfstring(L, "on device %d", ws_cuda_stream_device(stream));
}

// _cuda.event(device[, timing]) -> event | nil, message, CODE
static int cuda_event(lua_State *L) {
  int device = check_device(L, 1);
  int timing = lua_toboolean(L, 2);
  ws_lua_push_box(L, event_class, NULL);
  ws_cuda_event *event = NULL;
  int status = ws_cuda_event_create(device, timing, &event);
  return ws_lua_fill_box(L, status, event);
}

// event:record([stream]) -> true | nil, message, CODE
static int event_record(lua_State *L) {
  ws_cuda_event *event = ws_lua_check_box(L, 1, event_class);
  return ws_lua_push_ok(
      L, ws_cuda_event_record(event, ws_lua_opt_cuda_stream(L, 2)));
}

// event:query() -> done | nil, message, CODE
static int event_query(lua_State *L) {
  int done = 0;
  int status = ws_cuda_event_query(ws_lua_check_box(L, 1, event_class), &done);
  return ws_lua_push_boolean_result(L, status, done);
}

// event:synchronize() -> true | nil, message, CODE (blocks, no spinning)
static int event_synchronize(lua_State *L) {
  return ws_lua_push_ok(
      L, ws_cuda_event_synchronize(ws_lua_check_box(L, 1, event_class)));
}

// event:elapsed(start) -> milliseconds from `start` to this event
static int event_elapsed(lua_State *L) {
  ws_cuda_event *end = ws_lua_check_box(L, 1, event_class);
  ws_cuda_event *start = ws_lua_check_box(L, 2, event_class);
  double milliseconds = 0;
  int status = ws_cuda_event_elapsed(start, end, &milliseconds);
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_pushnumber(L, milliseconds);
  return 1;
}

static int destroy_event(void *event) { return ws_cuda_event_destroy(event); }

// ---------------------------------------------------------------------------
// Plans

static void push_info(lua_State *L, const ws_cuda_plan_info *info) {
  lua_createtable(L, 0, 9);
  ws_lua_set_number(L, "tile", info->tile);
  ws_lua_set_number(L, "ops", info->ops);
  ws_lua_set_number(L, "pieces", info->pieces);
  ws_lua_set_number(L, "warps", info->warps);
  ws_lua_set_number(L, "blocks", info->blocks);
  ws_lua_set_number(L, "bytes", info->bytes);
  ws_lua_set_number(L, "device_bytes", info->device_bytes);
  ws_lua_set_number(L, "bulk", info->bulk);
  ws_lua_set_number(L, "bulk_bytes", info->bulk_bytes);
}

// A plan's class: how its plan reports itself and (NULL for a synthetic plan,
// which fills and checks instead) launches.
typedef struct plan_class {
  ws_lua_class base; // first: what ws_lua_class_of answers is this class
  void (*info)(const void *plan, ws_cuda_plan_info *out);
  int (*launch)(void *plan, ws_cuda_stream *stream);
} plan_class;

// plan:launch([stream]) -> true | nil, message, CODE (queued)
static int plan_launch(lua_State *L) {
  const plan_class *class = (const plan_class *)ws_lua_class_of(L);
  void *plan = ws_lua_check_box(L, 1, class->base.name);
  return ws_lua_push_ok(L, class->launch(plan, ws_lua_opt_cuda_stream(L, 2)));
}

// plan:info() -> {ops, pieces, warps, blocks, bytes, device_bytes, tile}
static int plan_info(lua_State *L) {
  const plan_class *class = (const plan_class *)ws_lua_class_of(L);
  ws_cuda_plan_info info;
  class->info(ws_lua_check_box(L, 1, class->base.name), &info);
  push_info(L, &info);
  return 1;
}

// "OPS ops, BYTES bytes", after a plan's class name.
static void describe_plan(lua_State *L, void *plan) {
  ws_cuda_plan_info info;
  ((const plan_class *)ws_lua_class_of(L))->info(plan, &info);
  lua_pushfstring(L, "%f ops, %f bytes", (lua_Number)info.ops,
                  (lua_Number)info.bytes);
}

// The core's plan functions, typed for plan_class.
static int close_copy_plan(void *plan) { return ws_cuda_copy_plan_close(plan); }
static int close_synth_plan(void *plan) {
  return ws_cuda_synth_plan_close(plan);
}
static int close_fp8_plan(void *plan) { return ws_cuda_fp8_plan_close(plan); }
static void copy_plan_info(const void *plan, ws_cuda_plan_info *out) {
  ws_cuda_copy_plan_info(plan, out);
}
static void synth_plan_info(const void *plan, ws_cuda_plan_info *out) {
  ws_cuda_synth_plan_info(plan, out);
}
static void fp8_plan_info(const void *plan, ws_cuda_plan_info *out) {
  ws_cuda_fp8_plan_info(plan, out);
}
static int launch_copy_plan(void *plan, ws_cuda_stream *stream) {
  return ws_cuda_copy_plan_launch(plan, stream);
}
static int launch_fp8_plan(void *plan, ws_cuda_stream *stream) {
  return ws_cuda_fp8_plan_launch(plan, stream);
}

static const plan_class copy_plans = {
    {copy_plan_class, "close", close_copy_plan, NULL, describe_plan},
    copy_plan_info, launch_copy_plan};
static const plan_class synth_plans = {
    {synth_plan_class, "close", close_synth_plan, NULL, describe_plan},
    synth_plan_info, NULL};
static const plan_class fp8_plans = {
    {fp8_plan_class, "close", close_fp8_plan, NULL, describe_plan},
    fp8_plan_info, launch_fp8_plan};

// A region index of a table op: 1-based in Lua, 0-based in the core.
static uint32_t op_region(lua_State *L, int table, size_t position,
                          const char *name) {
  uint64_t index = ws_lua_op_field(L, table, position, name, 1, 0);
  if (index < 1 || index > UINT32_MAX)
    luaL_error(L, "op %d: field %s must be a region index from 1",
               (int)position, name);
  return (uint32_t)(index - 1);
}

// {target, source, target_offset, source_offset, rows, width, target_pitch,
// source_pitch}: regions from 1; rows 1, offsets 0 and pitches = width unless
// given.
static void convert_copy_op(lua_State *L, int table, size_t position,
                            void *record) {
  ws_cuda_copy_op *op = record;
  op->target_region = op_region(L, table, position, "target");
  op->source_region = op_region(L, table, position, "source");
  op->target_offset = ws_lua_op_field(L, table, position, "target_offset", 0, 0);
  op->source_offset = ws_lua_op_field(L, table, position, "source_offset", 0, 0);
  op->rows = ws_lua_op_field(L, table, position, "rows", 0, 1);
  op->width = ws_lua_op_field(L, table, position, "width", 1, 0);
  op->target_pitch =
      ws_lua_op_field(L, table, position, "target_pitch", 0, op->width);
  op->source_pitch =
      ws_lua_op_field(L, table, position, "source_pitch", 0, op->width);
}

// _cuda.copy_plan(device, regions, ops[, {tile = bytes, bulk = bytes}]) ->
// plan | nil, message, CODE (with `tile`, the tiled layout; with `bulk`, runs
// of at least that many contiguous bytes copied by CUDA's own copy:
// ws_cuda_copy_options)
static int cuda_copy_plan(lua_State *L) {
  int device = check_device(L, 1);
  ws_cuda_copy_options options = {0, 0};
  if (!lua_isnoneornil(L, 4)) {
    luaL_checktype(L, 4, LUA_TTABLE);
    lua_getfield(L, 4, "tile"); // [.., options, tile]
    if (!lua_isnil(L, -1)) {
      lua_Number bytes = luaL_checknumber(L, -1);
      if (bytes < 1 || bytes > (lua_Number)WS_CUDA_TILE_MAX ||
          bytes != (lua_Number)(uint64_t)bytes)
        return luaL_argerror(L, 4, "tile must be a whole number of bytes");
      options.tile = (uint64_t)bytes;
    }
    lua_getfield(L, 4, "bulk"); // [.., options, tile, bulk]
    if (!lua_isnil(L, -1)) {
      lua_Number bytes = luaL_checknumber(L, -1);
      if (bytes < 0 || bytes > 9007199254740992.0 ||
          bytes != (lua_Number)(uint64_t)bytes)
        return luaL_argerror(L, 4, "bulk must be a whole number of bytes");
      options.bulk = (uint64_t)bytes;
    }
    lua_pop(L, 2);
  }
  size_t region_count = 0, count = 0;
  const ws_cuda_region *regions =
      ws_lua_check_cuda_regions(L, 2, &region_count);
  const ws_cuda_copy_op *ops = ws_lua_check_ops(
      L, 3, sizeof(ws_cuda_copy_op), convert_copy_op, &count);
  ws_lua_push_box(L, copy_plan_class, NULL); // [.., regions, ops, box]
  keep_referenced(L, 2, 2);
  ws_cuda_copy_plan *plan = NULL;
  int status = ws_cuda_copy_plan_create_with(device, regions, region_count,
                                             ops, count, &options, &plan);
  return ws_lua_fill_box(L, status, plan);
}

// {region, dtype, offset, rows, elements, pitch, first, element_pitch, name |
// seed}: region from 1; dtype "bfloat16" unless given; rows 1, offset and
// first 0, pitch = elements x element size, element_pitch = elements unless
// given; the seed from the tensor name (ws_synth_seed) or given.
static void convert_synth_op(lua_State *L, int table, size_t position,
                             void *record) {
  ws_cuda_synth_op *op = record;
  op->region = op_region(L, table, position, "region");
  lua_getfield(L, table, "dtype");
  size_t length = 0;
  const char *dtype_name = lua_tolstring(L, -1, &length);
  ws_dtype dtype = dtype_name == NULL
                       ? WS_DTYPE_BFLOAT16
                       : ws_dtype_from_name(dtype_name, length);
  if (dtype == WS_DTYPE_COUNT)
    luaL_error(L, "op %d: unknown dtype %s", (int)position, dtype_name);
  lua_pop(L, 1);
  op->dtype = (uint32_t)dtype;
  op->offset = ws_lua_op_field(L, table, position, "offset", 0, 0);
  op->rows = ws_lua_op_field(L, table, position, "rows", 0, 1);
  op->row_elements = ws_lua_op_field(L, table, position, "elements", 1, 0);
  op->target_pitch = ws_lua_op_field(L, table, position, "pitch", 0,
                                     op->row_elements * ws_dtype_size(dtype));
  op->first = ws_lua_op_field(L, table, position, "first", 0, 0);
  op->element_pitch = ws_lua_op_field(L, table, position, "element_pitch", 0,
                                      op->row_elements);
  lua_getfield(L, table, "name");
  const char *name = lua_tolstring(L, -1, &length);
  if (name != NULL)
    op->seed = ws_synth_seed(name, length);
  lua_pop(L, 1);
  if (name == NULL)
    op->seed = ws_lua_op_field(L, table, position, "seed", 1, 0);
}

// _cuda.synth_plan(device, regions, ops) -> plan | nil, message, CODE
static int cuda_synth_plan(lua_State *L) {
  int device = check_device(L, 1);
  size_t region_count = 0, count = 0;
  const ws_cuda_region *regions =
      ws_lua_check_cuda_regions(L, 2, &region_count);
  const ws_cuda_synth_op *ops = ws_lua_check_ops(
      L, 3, sizeof(ws_cuda_synth_op), convert_synth_op, &count);
  ws_lua_push_box(L, synth_plan_class, NULL);
  keep_referenced(L, 2, 2);
  ws_cuda_synth_plan *plan = NULL;
  int status = ws_cuda_synth_plan_create(device, regions, region_count, ops,
                                         count, &plan);
  return ws_lua_fill_box(L, status, plan);
}

static uint32_t check_version(lua_State *L, int index) {
  uint64_t version = ws_lua_check_count(L, index);
  if (version > UINT32_MAX)
    luaL_argerror(L, index, "a version fits 32 bits");
  return (uint32_t)version;
}

// Queues `launch` (a fill or a check) of the synthetic plan at 1 at the
// version at 2 on the stream at 3: true | nil, message, CODE.
static int queue_synth(lua_State *L,
                       int (*launch)(ws_cuda_synth_plan *plan, uint32_t version,
                                     ws_cuda_stream *stream)) {
  ws_cuda_synth_plan *plan = ws_lua_check_box(L, 1, synth_plan_class);
  uint32_t version = check_version(L, 2);
  return ws_lua_push_ok(L, launch(plan, version, ws_lua_opt_cuda_stream(L, 3)));
}

// plan:fill(version[, stream]) -> true | nil, message, CODE (queued)
static int synth_plan_fill(lua_State *L) {
  return queue_synth(L, ws_cuda_synth_plan_fill);
}

// plan:check(version[, stream]) -> true | nil, message, CODE (queued)
static int synth_plan_check(lua_State *L) {
  return queue_synth(L, ws_cuda_synth_plan_check);
}

// plan:result() -> {mismatches, op (from 1), element} | nil, message, CODE;
// waits for the last check
static int synth_plan_result(lua_State *L) {
  ws_cuda_synth_result result;
  int status =
      ws_cuda_synth_plan_result(ws_lua_check_box(L, 1, synth_plan_class),
                                &result);
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_createtable(L, 0, 3);
  ws_lua_set_number(L, "mismatches", result.mismatches);
  if (result.mismatches > 0) {
    ws_lua_set_number(L, "op", result.first_op + 1);
    ws_lua_set_number(L, "element", result.first_element);
  }
  return 1;
}

// {target, scale_offset}: the region of a group's float32 scale from 1.
static void convert_fp8_group(lua_State *L, int table, size_t position,
                              void *record) {
  ws_fp8_group *group = record;
  group->target = op_region(L, table, position, "target");
  group->scale_offset = ws_lua_op_field(L, table, position, "scale_offset", 1, 0);
}

// {group, target, source, target_offset, source_offset, rows, columns,
// target_pitch, source_pitch}: the group and regions from 1; rows 1, offsets
// 0, pitches the row's bytes (columns, 2 x columns) unless given.
static void convert_fp8_op(lua_State *L, int table, size_t position,
                           void *record) {
  ws_fp8_op *op = record;
  uint64_t group = ws_lua_op_field(L, table, position, "group", 1, 0);
  if (group < 1)
    luaL_error(L, "op %d: field group must be a group index from 1",
               (int)position);
  op->group = group - 1;
  op->target = op_region(L, table, position, "target");
  op->source = op_region(L, table, position, "source");
  op->target_offset = ws_lua_op_field(L, table, position, "target_offset", 0, 0);
  op->source_offset = ws_lua_op_field(L, table, position, "source_offset", 0, 0);
  op->rows = ws_lua_op_field(L, table, position, "rows", 0, 1);
  op->columns = ws_lua_op_field(L, table, position, "columns", 1, 0);
  op->target_pitch =
      ws_lua_op_field(L, table, position, "target_pitch", 0, op->columns);
  op->source_pitch =
      ws_lua_op_field(L, table, position, "source_pitch", 0, 2 * op->columns);
}

// _cuda.fp8_plan(device, regions, groups, ops) -> plan | nil, message, CODE
static int cuda_fp8_plan(lua_State *L) {
  int device = check_device(L, 1);
  size_t region_count = 0, group_count = 0, count = 0;
  const ws_cuda_region *regions =
      ws_lua_check_cuda_regions(L, 2, &region_count);
  const ws_fp8_group *groups = ws_lua_check_ops(
      L, 3, sizeof(ws_fp8_group), convert_fp8_group, &group_count);
  const ws_fp8_op *ops =
      ws_lua_check_ops(L, 4, sizeof(ws_fp8_op), convert_fp8_op, &count);
  ws_lua_push_box(L, fp8_plan_class, NULL);
  keep_referenced(L, 2, 2);
  ws_cuda_fp8_plan *plan = NULL;
  int status = ws_cuda_fp8_plan_create(device, regions, region_count, groups,
                                       group_count, ops, count, &plan);
  return ws_lua_fill_box(L, status, plan);
}

// ---------------------------------------------------------------------------
// Module

// _cuda.counters() -> {allocations, frees, live_bytes, exports, ipc_opens,
// ipc_closes, mappings_reused, live_mappings, launches}
static int cuda_counters(lua_State *L) {
  ws_cuda_counters counters;
  ws_cuda_counters_get(&counters);
  lua_createtable(L, 0, 9);
#define WS_COUNTER_FIELD(name) ws_lua_set_number(L, #name, counters.name);
  WS_COUNTER_FIELD(allocations)
  WS_COUNTER_FIELD(frees)
  WS_COUNTER_FIELD(live_bytes)
  WS_COUNTER_FIELD(exports)
  WS_COUNTER_FIELD(ipc_opens)
  WS_COUNTER_FIELD(ipc_closes)
  WS_COUNTER_FIELD(mappings_reused)
  WS_COUNTER_FIELD(live_mappings)
  WS_COUNTER_FIELD(launches)
#undef WS_COUNTER_FIELD
  return 1;
}

int luaopen_wsync_cuda(lua_State *L) {
  static const ws_lua_class streams = {stream_class, "close", destroy_stream,
                                       NULL, describe_stream};
  static const ws_lua_class events = {event_class, "close", destroy_event,
                                      NULL, NULL};
  static const luaL_Reg memory_methods[] = { // buffers' and mappings'
      {"region", region_table}, {"pointer", region_pointer},
      {"size", region_size},    {"device", region_device},
      {"read", cuda_read},      {"write", cuda_write},
      {"fill", cuda_fill},      {NULL, NULL},
  };
  static const luaL_Reg buffer_methods[] = {
      {"export", buffer_export}, {NULL, NULL}};
  static const luaL_Reg stream_methods[] = {
      {"synchronize", stream_synchronize},
      {"wait_value", stream_wait_value},
      {"write_value", stream_write_value},
      {"device", stream_device},
      {NULL, NULL},
  };
  static const luaL_Reg event_methods[] = {
      {"record", event_record},   {"query", event_query},
      {"synchronize", event_synchronize}, {"elapsed", event_elapsed},
      {NULL, NULL},
  };
  static const luaL_Reg plan_methods[] = {
      {"launch", plan_launch}, {"info", plan_info}, {NULL, NULL}};
  static const luaL_Reg synth_plan_methods[] = {
      {"fill", synth_plan_fill},     {"check", synth_plan_check},
      {"result", synth_plan_result}, {"info", plan_info},
      {NULL, NULL},
  };
  static const luaL_Reg functions[] = {
      {"buffer", cuda_buffer},         {"import", cuda_import},
      {"stream", cuda_stream},         {"event", cuda_event},
      {"copy_plan", cuda_copy_plan},   {"synth_plan", cuda_synth_plan},
      {"fp8_plan", cuda_fp8_plan},
      {"read", cuda_read},             {"write", cuda_write},
      {"fill", cuda_fill},             {"memcpy", cuda_memcpy},
      {"counters", cuda_counters},     {"export_region", cuda_export_region},
      {NULL, NULL},
  };
  ws_lua_new_class(L, &buffers.base, memory_methods);
  ws_lua_add_methods(L, &buffers.base, buffer_methods);
  ws_lua_new_class(L, &mappings.base, memory_methods);
  ws_lua_new_class(L, &streams, stream_methods);
  ws_lua_new_class(L, &events, event_methods);
  ws_lua_new_class(L, &copy_plans.base, plan_methods);
  ws_lua_new_class(L, &synth_plans.base, synth_plan_methods);
  ws_lua_new_class(L, &fp8_plans.base, plan_methods);
  ws_lua_new_module(L, functions); // [module]
  lua_pushboolean(L, ws_device_cuda_built());
  lua_setfield(L, -2, "built");
  return 1;
}
