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

/// Maps `size` bytes of private anonymous memory (no name, not importable):
/// the host backend's stand-in for memory that never leaves its process.
int ws_shm_create_anonymous(size_t size, ws_shm **out);

/// Maps an existing segment by name, read-write, at its full size.
int ws_shm_open(const char *name, ws_shm **out);

/// Returns the mapped bytes.
void *ws_shm_data(const ws_shm *shm);

/// Returns the mapped size in bytes.
size_t ws_shm_size(const ws_shm *shm);

/// Copies `length` bytes from `source` at `source_offset` to `target` at
/// `target_offset`; both ranges must lie inside their buffers. The buffers may
/// be the same object only when the ranges do not overlap.
int ws_shm_copy(ws_shm *target, size_t target_offset, const ws_shm *source,
                size_t source_offset, size_t length);

/// Writes the SHA-256 of `length` bytes at `offset` as 64 hex characters plus
/// a NUL into `hex_out`.
int ws_shm_sha256(const ws_shm *shm, size_t offset, size_t length,
                  char *hex_out);

/// Returns the segment's name ("" when anonymous), for export to another
/// process.
const char *ws_shm_name(const ws_shm *shm);

/// Returns 1 when this mapping created the segment, 0 when it imported it.
int ws_shm_is_owner(const ws_shm *shm);

/// Removes the segment's name so that no new process can open it; mappings
/// stay valid. A second unlink is a no-op.
int ws_shm_unlink(ws_shm *shm);

/// Unmaps the segment, unlinks it when this mapping owns it, and frees the
/// object. NULL is accepted. Returns the first failure, after finishing.
int ws_shm_close(ws_shm *shm);
