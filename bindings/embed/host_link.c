// The weak host link (host_link.h). One thread uses a host and its agents, so
// the count needs no atomics.
#include "host_link.h"

#include <stdlib.h>

struct ws_host_link {
  ws_host *host; // NULL once the host closed
  int references;
};

ws_host_link *ws_host_link_new(ws_host *host) {
  ws_host_link *link = malloc(sizeof *link);
  if (link == NULL)
    return NULL;
  link->host = host;
  link->references = 1;
  return link;
}

ws_host_link *ws_host_link_retain(ws_host_link *link) {
  link->references++;
  return link;
}

void ws_host_link_release(ws_host_link *link) {
  if (link != NULL && --link->references == 0)
    free(link);
}

ws_host *ws_host_link_get(const ws_host_link *link) { return link->host; }

void ws_host_link_clear(ws_host_link *link) { link->host = NULL; }
