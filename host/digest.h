// SHA-256 of a byte range and lowercase hexadecimal encoding.
#pragma once

#include "status_defs.h"

#ifndef WS_FFI
#include <stddef.h>
#endif

enum { WS_SHA256_BYTES = 32, WS_SHA256_HEX_LENGTH = 64 };

/// Writes `size` bytes as 2 x `size` lowercase hex characters plus a NUL.
void ws_hex_encode(const unsigned char *bytes, size_t size, char *hex_out);

/// Computes the SHA-256 of `size` bytes into `digest_out` (32 bytes).
int ws_sha256(const void *data, size_t size, unsigned char *digest_out);

/// Computes the SHA-256 of `size` bytes as 64 hex characters plus a NUL.
int ws_sha256_hex(const void *data, size_t size, char *hex_out);
