// Manifest: a SHA-256 digest over the ordered structural records of a model.
//
// A manifest names what a publication carries, not its values: for each tensor
// its name, dtype, shape, element count and byte count, in stream order. It is
// fed one record at a time, so 40,000 records hash without a big string.
//
// Byte encoding, version 1 (all integers little-endian, no padding):
//
//   preamble   the 18 ASCII bytes "wsync-manifest-v1\n"
//   per record u32 name length, name bytes (UTF-8, no terminator)
//              u32 dtype-name length, dtype-name bytes ("bfloat16")
//              u32 number of dimensions, then u64 per dimension
//              u64 element count (1 for a scalar)
//              u64 byte count (element count x element size)
//   trailer    u64 record count
//
// The digest is written as 64 lowercase hexadecimal characters. Changing this
// encoding changes every digest: bump the preamble's version when it does.
#pragma once

#include "dtype.h"
#include "status_defs.h"

#ifndef WS_FFI
#include <stddef.h>
#include <stdint.h>
#endif

enum {
  WS_MANIFEST_MAX_DIMS = 8,
  WS_MANIFEST_HEX_LENGTH = 64,
};

typedef struct ws_manifest ws_manifest;

/// Starts an empty manifest and stores it in `*out`.
int ws_manifest_new(ws_manifest **out);

/// Appends one record; computes its element and byte counts from the shape.
int ws_manifest_add(ws_manifest *manifest, const char *name,
                    size_t name_length, ws_dtype dtype, const int64_t *shape,
                    int dims);

/// Ends the manifest and writes its digest as 64 hex characters plus a NUL.
/// Later calls write the same digest; later adds fail with WS_ESTATE.
int ws_manifest_finish(ws_manifest *manifest, char *hex_out);

/// Returns the number of records added so far.
uint64_t ws_manifest_count(const ws_manifest *manifest);

/// Returns the sum of the byte counts of the records added so far.
uint64_t ws_manifest_bytes(const ws_manifest *manifest);

/// Releases a manifest; NULL is accepted.
void ws_manifest_free(ws_manifest *manifest);

/// A run of records encoded once and added to many manifests in one step: a
/// chunk's part of a publication's manifest, the same in every publication.
typedef struct ws_manifest_segment ws_manifest_segment;

/// Starts an empty segment and stores it in `*out`.
int ws_manifest_segment_new(ws_manifest_segment **out);

/// Appends one record to a segment (checked as ws_manifest_add checks it).
int ws_manifest_segment_add(ws_manifest_segment *segment, const char *name,
                            size_t name_length, ws_dtype dtype,
                            const int64_t *shape, int dims);

/// Returns the number of records in a segment.
uint64_t ws_manifest_segment_count(const ws_manifest_segment *segment);

/// Adds every record of `segment`, in order, as ws_manifest_add would.
int ws_manifest_add_segment(ws_manifest *manifest,
                            const ws_manifest_segment *segment);

/// Releases a segment; NULL is accepted.
void ws_manifest_segment_free(ws_manifest_segment *segment);
