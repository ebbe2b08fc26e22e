// `wsync._nccl`: NCCL communicators among trainer ranks (host/nccl_comm.h),
// loaded on first use.
#include "l_cuda.h"

#include "nccl_comm.h"

static const char comm_class[] = "wsync.nccl.comm";

// _nccl.load() -> true | nil, message, CODE (ENODEV names what is missing)
static int nccl_load(lua_State *L) {
  return ws_lua_push_ok(L, ws_nccl_load());
}

// _nccl.version() -> 22809 | nil, message, CODE
static int nccl_version(lua_State *L) {
  int version = 0;
  int status = ws_nccl_version(&version);
  return ws_lua_push_integer_result(L, status, version);
}

// _nccl.unique_id() -> 128-byte id | nil, message, CODE
static int nccl_unique_id(lua_State *L) {
  unsigned char id[WS_NCCL_UNIQUE_ID_BYTES];
  int status = ws_nccl_unique_id(id);
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_pushlstring(L, (const char *)id, sizeof id);
  return 1;
}

// _nccl.init(device, world, rank, id[, nonblocking]) -> comm | nil, message,
// CODE
static int nccl_init(lua_State *L) {
  lua_Integer device = luaL_checkinteger(L, 1);
  lua_Integer world = luaL_checkinteger(L, 2);
  lua_Integer rank = luaL_checkinteger(L, 3);
  size_t length = 0;
  const char *id = luaL_checklstring(L, 4, &length);
  if (length != WS_NCCL_UNIQUE_ID_BYTES)
    luaL_argerror(L, 4, "expected a 128-byte ncclUniqueId");
  if (device < 0 || device > 1 << 20)
    luaL_argerror(L, 1, "expected a device index");
  if (world < 1 || world > 1 << 20)
    luaL_argerror(L, 2, "expected a world size");
  if (rank < 0 || rank >= world)
    luaL_argerror(L, 3, "expected a rank of the world");
  int nonblocking = lua_toboolean(L, 5);
  ws_lua_push_box(L, comm_class, NULL);
  ws_nccl_comm *comm = NULL;
  int status = ws_nccl_comm_init((int)device, (int)world, (int)rank,
                                 (const unsigned char *)id, nonblocking, &comm);
  return ws_lua_fill_box(L, status, comm);
}

// comm:ready() -> ready | nil, message, CODE
static int comm_ready(lua_State *L) {
  int ready = 0;
  int status = ws_nccl_comm_ready(ws_lua_check_box(L, 1, comm_class), &ready);
  return ws_lua_push_boolean_result(L, status, ready);
}

// comm:rank(), comm:world(), comm:device() -> integer
static int comm_rank(lua_State *L) {
  lua_pushinteger(L, ws_nccl_comm_rank(ws_lua_check_box(L, 1, comm_class)));
  return 1;
}

static int comm_world(lua_State *L) {
  lua_pushinteger(L, ws_nccl_comm_world(ws_lua_check_box(L, 1, comm_class)));
  return 1;
}

static int comm_device(lua_State *L) {
  lua_pushinteger(L, ws_nccl_comm_device(ws_lua_check_box(L, 1, comm_class)));
  return 1;
}

// {root (a rank, from 0), target_offset, bytes, source (a region, from 1),
// source_offset}: source only on the root.
static void convert_broadcast(lua_State *L, int table, size_t position,
                              void *record) {
  ws_nccl_broadcast *op = record;
  uint64_t root = ws_lua_op_field(L, table, position, "root", 1, 0);
  if (root > INT32_MAX)
    luaL_error(L, "op %d: root %f is no rank", (int)position, (double)root);
  op->root = (int32_t)root;
  op->target_offset = ws_lua_op_field(L, table, position, "target_offset", 0, 0);
  op->bytes = ws_lua_op_field(L, table, position, "bytes", 1, 0);
  op->source_offset = ws_lua_op_field(L, table, position, "source_offset", 0, 0);
  uint64_t source = ws_lua_op_field(L, table, position, "source", 0, 0);
  op->source_region = source >= 1 && source <= UINT32_MAX
                          ? (uint32_t)(source - 1)
                          : UINT32_MAX;
}

// comm:fill(stream, target, sources, broadcasts) -> true | nil, message, CODE
// (one group, queued on the stream; nil stream: the legacy default stream)
static int comm_fill(lua_State *L) {
  ws_nccl_comm *comm = ws_lua_check_box(L, 1, comm_class);
  ws_cuda_stream *stream = ws_lua_opt_cuda_stream(L, 2);
  ws_cuda_region target;
  ws_lua_check_cuda_region(L, 3, &target);
  size_t source_count = 0, count = 0;
  const ws_cuda_region *sources =
      ws_lua_check_cuda_regions(L, 4, &source_count);
  const ws_nccl_broadcast *ops = ws_lua_check_ops(
      L, 5, sizeof(ws_nccl_broadcast), convert_broadcast, &count);
  return ws_lua_push_ok(L, ws_nccl_fill(comm, stream, &target, sources,
                                              source_count, ops, count));
}

// comm:all_gather(stream, target, target_offset, source, source_offset,
// bytes) -> true | nil, message, CODE (queued)
static int comm_all_gather(lua_State *L) {
  ws_nccl_comm *comm = ws_lua_check_box(L, 1, comm_class);
  ws_cuda_stream *stream = ws_lua_opt_cuda_stream(L, 2);
  ws_lua_region_copy copy;
  ws_lua_check_region_copy(L, 3, &copy);
  return ws_lua_push_ok(
      L, ws_nccl_all_gather(comm, stream, &copy.target, copy.target_offset,
                            &copy.source, copy.source_offset, copy.bytes));
}

// comm:abort() -> true | nil, message, CODE (without waiting: poison)
static int comm_abort(lua_State *L) {
  ws_nccl_comm *comm = ws_lua_take_box(L, 1, comm_class);
  return ws_lua_push_ok(L, ws_nccl_comm_abort(comm));
}

// comm:destroy(): after its queued work.
static int destroy_comm(void *comm) { return ws_nccl_comm_destroy(comm); }

// The safety net aborts: a finalizer must not wait for peers.
static int abort_comm(void *comm) { return ws_nccl_comm_abort(comm); }

static void describe_comm(lua_State *L, void *comm) {
  lua_pushfstring(L, "rank %d of %d on device %d", ws_nccl_comm_rank(comm),
                  ws_nccl_comm_world(comm), ws_nccl_comm_device(comm));
}

int luaopen_wsync_nccl(lua_State *L) {
  static const ws_lua_class comms = {comm_class, "destroy", destroy_comm,
                                     abort_comm, describe_comm};
  static const luaL_Reg methods[] = {
      {"ready", comm_ready},   {"rank", comm_rank},
      {"world", comm_world},   {"device", comm_device},
      {"fill", comm_fill},     {"all_gather", comm_all_gather},
      {"abort", comm_abort},   {NULL, NULL},
  };
  static const luaL_Reg functions[] = {
      {"load", nccl_load},
      {"version", nccl_version},
      {"unique_id", nccl_unique_id},
      {"init", nccl_init},
      {NULL, NULL},
  };
  ws_lua_new_class(L, &comms, methods);
  return ws_lua_new_module(L, functions);
}
