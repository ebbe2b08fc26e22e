// Shared-memory buffers for the host backend (POSIX shm_open + mmap).
//
// The creator owns the name: closing the creator's buffer also unlinks the name
// unless it was unlinked before. An importer maps an existing name and only
// unmaps on close. Names look like "/wsync-<pid>-<16 hex digits>".
#pragma once

#include "status_defs.h"

#ifndef WS_FFI
#include <stddef.h>
#endif

enum { WS_SHM_NAME_MAX = 64 };

typedef struct ws_shm ws_shm;

/// Creates a new zero-filled segment of `size` bytes with a fresh private name
/// (mode 0600), reserves its pages, and maps it read-write.
int ws_shm_create(size_t size, ws_shm **out);

/// Maps an existing segment by name, read-write, at its full size.
int ws_shm_open(const char *name, ws_shm **out);

/// Returns the mapped bytes.
void *ws_shm_data(const ws_shm *shm);

/// Returns the mapped size in bytes.
size_t ws_shm_size(const ws_shm *shm);

/// Returns the segment's name, for export to another process.
const char *ws_shm_name(const ws_shm *shm);

/// Returns 1 when this mapping created the segment, 0 when it imported it.
int ws_shm_is_owner(const ws_shm *shm);

/// Removes the segment's name so that no new process can open it; mappings
/// stay valid. A second unlink is a no-op.
int ws_shm_unlink(ws_shm *shm);

/// Unmaps the segment, unlinks it when this mapping owns it, and frees the
/// object. NULL is accepted. Returns the first failure, after finishing.
int ws_shm_close(ws_shm *shm);
