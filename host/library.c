#include "library.h"

#include "status.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

static void clear_slots(ws_library *library) {
  for (size_t i = 0; i < library->count; i++)
    *library->symbols[i].slot = NULL;
}

// Opens and starts `library`: a status, the reason in its detail.
static int open_library(ws_library *library) {
  const char *path = getenv(library->variable);
  if (path == NULL || path[0] == '\0')
    path = library->default_path;
  void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (handle == NULL) {
    const char *why = dlerror();
    snprintf(library->detail, sizeof library->detail,
             "%s: cannot load %s (%s): %s", library->prefix, path,
             library->purpose, why != NULL ? why : "unknown reason");
    return WS_ENODEV;
  }
  int status = WS_OK;
  for (size_t i = 0; i < library->count && status == WS_OK; i++) {
    const ws_library_symbol *symbol = &library->symbols[i];
    *symbol->slot = dlsym(handle, symbol->name);
    if (*symbol->slot == NULL && symbol->required) {
      const char *needs = library->needs;
      snprintf(library->detail, sizeof library->detail, "%s: %s has no %s%s%s%s",
               library->prefix, path, symbol->name, needs != NULL ? " (" : "",
               needs != NULL ? needs : "", needs != NULL ? ")" : "");
      status = WS_ENODEV;
    }
  }
  if (status == WS_OK && library->start != NULL)
    status = library->start(path, library->detail, sizeof library->detail);
  if (status != WS_OK) {
    clear_slots(library);
    dlclose(handle);
  }
  return status; // (loaded, the library stays open for the process)
}

int ws_library_load(ws_library *library) {
  pthread_mutex_lock(&library->lock);
  if (!library->tried) {
    library->tried = 1;
    library->status = open_library(library);
  }
  int status = library->status;
  pthread_mutex_unlock(&library->lock);
  if (status != WS_OK)
    return ws_fail(status, "%s", library->detail);
  return WS_OK;
}
