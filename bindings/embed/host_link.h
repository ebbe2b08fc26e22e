// A weak reference to a host: the objects that outlive their host's calls
// (agents) hold one, and the host clears it when it closes, so that the host
// needs to know nothing of them. Reference counted: the host holds one
// reference and each holder one more; the last release frees it.
#pragma once

#include "wsync.h"

typedef struct ws_host_link ws_host_link;

/// Creates a link to `host` with one reference (the host's). Returns NULL
/// when it cannot be allocated.
ws_host_link *ws_host_link_new(ws_host *host);

/// Adds a reference and returns `link`.
ws_host_link *ws_host_link_retain(ws_host_link *link);

/// Drops a reference; the last one frees the link. NULL is accepted.
void ws_host_link_release(ws_host_link *link);

/// Returns the host, or NULL once the host cleared the link (it closed).
ws_host *ws_host_link_get(const ws_host_link *link);

/// Cuts the link: every later ws_host_link_get returns NULL.
void ws_host_link_clear(ws_host_link *link);
