// What `wsync._cuda` (l_cuda.c) lends `wsync._nccl` (l_nccl.c): reading
// regions, region lists and streams from Lua arguments, and checked numbers.
// Hidden from libwsync's exports.
#pragma once

#include "cuda_memory.h"
#include "lua_util.h"
#include "modules.h"

#define WS_BINDING_INTERNAL __attribute__((visibility("hidden")))

/// Reads the region at `index`: a cuda buffer, an imported mapping, or a
/// table {pointer = address, size = bytes, device = index} (memory someone
/// else allocated). Raises an argument error otherwise.
WS_BINDING_INTERNAL void ws_lua_check_cuda_region(lua_State *L, int index,
                                                  ws_cuda_region *out);

/// The arguments of a copy between two regions: bytes from `source_offset`
/// in `source` to `target_offset` in `target`.
typedef struct ws_lua_region_copy {
  ws_cuda_region target;
  uint64_t target_offset;
  ws_cuda_region source;
  uint64_t source_offset;
  uint64_t bytes;
} ws_lua_region_copy;

/// Reads a copy's arguments from `index` on: target, target_offset, source,
/// source_offset, bytes (regions as ws_lua_check_cuda_region reads them).
WS_BINDING_INTERNAL void ws_lua_check_region_copy(lua_State *L, int index,
                                                  ws_lua_region_copy *out);

/// Reads the array of regions at `index` into scratch memory that the
/// collector owns (so that a later argument error leaks nothing); pushes that
/// scratch userdata and stores the count.
WS_BINDING_INTERNAL ws_cuda_region *
ws_lua_check_cuda_regions(lua_State *L, int index, size_t *count);

/// Reads the optional stream at `index` (none or nil: the device's legacy
/// default stream).
WS_BINDING_INTERNAL ws_cuda_stream *ws_lua_opt_cuda_stream(lua_State *L,
                                                           int index);

/// Reads a non-negative integer that a Lua number holds exactly (below 2^53).
WS_BINDING_INTERNAL uint64_t ws_lua_check_count(lua_State *L, int index);

/// Reads field `name` of the op table at `table` (the `position`th op) as a
/// non-negative integer; `fallback` when absent, unless `required`.
WS_BINDING_INTERNAL uint64_t ws_lua_op_field(lua_State *L, int table,
                                             size_t position, const char *name,
                                             int required, uint64_t fallback);

/// Reads the ops at `index`: a string of packed `record_size`-byte records
/// (ffi.string of an array of the core's op type, regions counted from 0), or
/// an array of tables converted by `convert` (regions counted from 1). Pushes
/// the scratch userdata holding them and stores the count.
WS_BINDING_INTERNAL void *
ws_lua_check_ops(lua_State *L, int index, size_t record_size,
                 void (*convert)(lua_State *L, int table, size_t position,
                                 void *record),
                 size_t *count);
