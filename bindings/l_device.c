// `wsync._device`: device identity and memory for the host and cuda backends.
#include "lua_util.h"
#include "modules.h"
#include "device.h"
#include "gpu_memory.h"

static ws_backend check_backend(lua_State *L, int index) {
  static const char *const names[] = {"host", "cuda", NULL};
  return (ws_backend)luaL_checkoption(L, index, NULL, names);
}

// _device.count(backend) -> n | nil, message, CODE
static int device_count(lua_State *L) {
  int count = 0;
  int status = ws_device_count(check_backend(L, 1), &count);
  return ws_lua_push_integer_result(L, status, count);
}

// _device.query(backend, index) -> {index, uuid, name, total_bytes,
// free_bytes} | nil, message, CODE
static int device_query(lua_State *L) {
  ws_backend backend = check_backend(L, 1);
  int index = (int)luaL_checkinteger(L, 2);
  ws_device_info info;
  int status = ws_device_query(backend, index, &info);
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_createtable(L, 0, 5);
  lua_pushinteger(L, info.index);
  lua_setfield(L, -2, "index");
  lua_pushstring(L, info.uuid);
  lua_setfield(L, -2, "uuid");
  lua_pushstring(L, info.name);
  lua_setfield(L, -2, "name");
  ws_lua_set_number(L, "total_bytes", info.total_bytes);
  ws_lua_set_number(L, "free_bytes", info.free_bytes);
  return 1;
}

// _device.gpu_memory(uuid) -> {total_bytes, used_bytes, free_bytes,
// reserved_bytes, processes = {{pid, used_bytes}, ...} | nil} | nil, message,
// CODE: the GPU's memory as its driver sees it (NVML; no CUDA context is
// made), the driver's reserve apart (host/gpu_memory.h). A process's
// used_bytes is nil where the driver does not say; processes is nil where
// NVML could not list them.
static int device_gpu_memory(lua_State *L) {
  ws_gpu_memory memory;
  int status = ws_gpu_memory_query(luaL_checkstring(L, 1), &memory);
  if (status != WS_OK)
    return ws_lua_push_failure(L, status);
  lua_createtable(L, 0, 5);
  ws_lua_set_number(L, "total_bytes", memory.total_bytes);
  ws_lua_set_number(L, "used_bytes", memory.used_bytes);
  ws_lua_set_number(L, "free_bytes", memory.free_bytes);
  ws_lua_set_number(L, "reserved_bytes", memory.reserved_bytes);
  if (memory.process_count >= 0) {
    lua_createtable(L, memory.process_count, 0);
    for (int i = 0; i < memory.process_count; i++) {
      lua_createtable(L, 0, 2);
      lua_pushinteger(L, (lua_Integer)memory.processes[i].pid);
      lua_setfield(L, -2, "pid");
      if (memory.processes[i].used_bytes != UINT64_MAX)
        ws_lua_set_number(L, "used_bytes", memory.processes[i].used_bytes);
      lua_rawseti(L, -2, i + 1);
    }
    lua_setfield(L, -2, "processes");
  }
  return 1;
}

int luaopen_wsync_device(lua_State *L) {
  static const luaL_Reg functions[] = {
      {"count", device_count},
      {"query", device_query},
      {"gpu_memory", device_gpu_memory},
      {NULL, NULL},
  };
  return ws_lua_new_module(L, functions);
}
