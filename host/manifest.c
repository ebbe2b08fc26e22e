#include "manifest.h"

#include "digest.h"
#include "status.h"

#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>

static const char manifest_preamble[] = "wsync-manifest-v1\n";

struct ws_manifest {
  EVP_MD_CTX *digest;
  uint64_t count;
  uint64_t bytes;
  int finished;
  char hex[WS_MANIFEST_HEX_LENGTH + 1];
};

static void put_u32(unsigned char *out, uint32_t value) {
  for (int i = 0; i < 4; i++)
    out[i] = (unsigned char)(value >> (8 * i));
}

static void put_u64(unsigned char *out, uint64_t value) {
  for (int i = 0; i < 8; i++)
    out[i] = (unsigned char)(value >> (8 * i));
}

static int digest_update(ws_manifest *manifest, const void *data, size_t size) {
  if (EVP_DigestUpdate(manifest->digest, data, size) != 1)
    return ws_fail(WS_ECRYPTO, "manifest: EVP_DigestUpdate failed");
  return WS_OK;
}

int ws_manifest_new(ws_manifest **out) {
  ws_clear_error();
  ws_manifest *manifest = calloc(1, sizeof *manifest);
  if (manifest == NULL)
    return ws_fail(WS_ENOMEM, "manifest: cannot allocate");
  manifest->digest = EVP_MD_CTX_new();
  if (manifest->digest == NULL ||
      EVP_DigestInit_ex(manifest->digest, EVP_sha256(), NULL) != 1) {
    ws_manifest_free(manifest);
    return ws_fail(WS_ECRYPTO, "manifest: cannot start SHA-256");
  }
  int status =
      digest_update(manifest, manifest_preamble, sizeof manifest_preamble - 1);
  if (status != WS_OK) {
    ws_manifest_free(manifest);
    return status;
  }
  *out = manifest;
  return WS_OK;
}

// The longest encoding of one record's fixed-size parts.
enum { RECORD_FIXED_MAX = 4 + 4 + 4 + 8 * WS_MANIFEST_MAX_DIMS + 8 + 8 };

// Encodes one record (version 1, see manifest.h) into `out`, which holds at
// least RECORD_FIXED_MAX + name_length + the dtype name's length bytes;
// stores its length in `*written` and its byte count in `*bytes`. `total` is
// the byte count so far (the sum must not overflow).
static int encode_record(const char *name, size_t name_length, ws_dtype dtype,
                         const int64_t *shape, int dims, uint64_t total,
                         unsigned char *out, size_t *written,
                         uint64_t *bytes) {
  const char *dtype_name = ws_dtype_name(dtype);
  if (dtype_name == NULL)
    return ws_fail(WS_EINVAL, "manifest: unknown dtype %d for '%.*s'",
                   (int)dtype, (int)name_length, name);
  if (name_length == 0 || name_length > UINT32_MAX)
    return ws_fail(WS_EINVAL, "manifest: record name length %zu is invalid",
                   name_length);
  if (dims < 0 || dims > WS_MANIFEST_MAX_DIMS)
    return ws_fail(WS_EINVAL, "manifest: '%.*s' has %d dimensions (0..%d)",
                   (int)name_length, name, dims, WS_MANIFEST_MAX_DIMS);
  uint64_t elements = 1;
  for (int i = 0; i < dims; i++) {
    if (shape[i] < 0)
      return ws_fail(WS_EINVAL, "manifest: '%.*s' dimension %d is %lld",
                     (int)name_length, name, i, (long long)shape[i]);
    if (shape[i] != 0 && elements > UINT64_MAX / (uint64_t)shape[i])
      return ws_fail(WS_EOVERFLOW, "manifest: '%.*s' element count overflows",
                     (int)name_length, name);
    elements *= (uint64_t)shape[i];
  }
  uint64_t element_size = ws_dtype_size(dtype);
  if (elements > UINT64_MAX / element_size ||
      total > UINT64_MAX - elements * element_size)
    return ws_fail(WS_EOVERFLOW, "manifest: '%.*s' byte count overflows",
                   (int)name_length, name);
  size_t dtype_length = strlen(dtype_name);
  size_t used = 0;
  put_u32(out + used, (uint32_t)name_length);
  used += 4;
  memcpy(out + used, name, name_length);
  used += name_length;
  put_u32(out + used, (uint32_t)dtype_length);
  used += 4;
  memcpy(out + used, dtype_name, dtype_length);
  used += dtype_length;
  put_u32(out + used, (uint32_t)dims);
  used += 4;
  for (int i = 0; i < dims; i++, used += 8)
    put_u64(out + used, (uint64_t)shape[i]);
  put_u64(out + used, elements);
  used += 8;
  put_u64(out + used, elements * element_size);
  used += 8;
  *written = used;
  *bytes = elements * element_size;
  return WS_OK;
}

// The most bytes one record of `name_length` can take.
static size_t record_capacity(size_t name_length) {
  return RECORD_FIXED_MAX + name_length + 32; // dtype names are short
}

int ws_manifest_add(ws_manifest *manifest, const char *name,
                    size_t name_length, ws_dtype dtype, const int64_t *shape,
                    int dims) {
  ws_clear_error();
  if (manifest->finished)
    return ws_fail(WS_ESTATE, "manifest: record added after finish");
  unsigned char fixed[RECORD_FIXED_MAX + 256 + 32];
  size_t capacity = record_capacity(name_length);
  unsigned char *record = fixed;
  if (capacity > sizeof fixed) {
    record = malloc(capacity);
    if (record == NULL)
      return ws_fail(WS_ENOMEM, "manifest: cannot allocate a record");
  }
  size_t written = 0;
  uint64_t bytes = 0;
  int status = encode_record(name, name_length, dtype, shape, dims,
                             manifest->bytes, record, &written, &bytes);
  if (status == WS_OK)
    status = digest_update(manifest, record, written);
  if (record != fixed)
    free(record);
  if (status != WS_OK)
    return status;
  manifest->count++;
  manifest->bytes += bytes;
  return WS_OK;
}

struct ws_manifest_segment {
  unsigned char *data;
  size_t length, capacity;
  uint64_t count;
  uint64_t bytes;
};

int ws_manifest_segment_new(ws_manifest_segment **out) {
  ws_clear_error();
  ws_manifest_segment *segment = calloc(1, sizeof *segment);
  if (segment == NULL)
    return ws_fail(WS_ENOMEM, "manifest segment: cannot allocate");
  *out = segment;
  return WS_OK;
}

int ws_manifest_segment_add(ws_manifest_segment *segment, const char *name,
                            size_t name_length, ws_dtype dtype,
                            const int64_t *shape, int dims) {
  ws_clear_error();
  size_t needed = record_capacity(name_length);
  if (segment->capacity - segment->length < needed) {
    size_t capacity = segment->capacity ? segment->capacity : 4096;
    while (capacity - segment->length < needed)
      capacity *= 2;
    unsigned char *data = realloc(segment->data, capacity);
    if (data == NULL)
      return ws_fail(WS_ENOMEM, "manifest segment: cannot grow to %zu bytes",
                     capacity);
    segment->data = data;
    segment->capacity = capacity;
  }
  size_t written = 0;
  uint64_t bytes = 0;
  int status =
      encode_record(name, name_length, dtype, shape, dims, segment->bytes,
                    segment->data + segment->length, &written, &bytes);
  if (status != WS_OK)
    return status;
  segment->length += written;
  segment->count++;
  segment->bytes += bytes;
  return WS_OK;
}

uint64_t ws_manifest_segment_count(const ws_manifest_segment *segment) {
  return segment->count;
}

int ws_manifest_add_segment(ws_manifest *manifest,
                            const ws_manifest_segment *segment) {
  ws_clear_error();
  if (manifest->finished)
    return ws_fail(WS_ESTATE, "manifest: segment added after finish");
  if (manifest->bytes > UINT64_MAX - segment->bytes)
    return ws_fail(WS_EOVERFLOW, "manifest: byte count overflows");
  int status = WS_OK;
  if (segment->length > 0)
    status = digest_update(manifest, segment->data, segment->length);
  if (status != WS_OK)
    return status;
  manifest->count += segment->count;
  manifest->bytes += segment->bytes;
  return WS_OK;
}

void ws_manifest_segment_free(ws_manifest_segment *segment) {
  if (segment == NULL)
    return;
  free(segment->data);
  free(segment);
}

int ws_manifest_finish(ws_manifest *manifest, char *hex_out) {
  ws_clear_error();
  if (!manifest->finished) {
    unsigned char trailer[8];
    put_u64(trailer, manifest->count);
    int status = digest_update(manifest, trailer, sizeof trailer);
    if (status != WS_OK)
      return status;
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int digest_length = 0;
    if (EVP_DigestFinal_ex(manifest->digest, digest, &digest_length) != 1 ||
        digest_length * 2 != WS_MANIFEST_HEX_LENGTH)
      return ws_fail(WS_ECRYPTO, "manifest: EVP_DigestFinal_ex failed");
    ws_hex_encode(digest, digest_length, manifest->hex);
    manifest->finished = 1;
  }
  memcpy(hex_out, manifest->hex, WS_MANIFEST_HEX_LENGTH + 1);
  return WS_OK;
}

uint64_t ws_manifest_count(const ws_manifest *manifest) {
  return manifest->count;
}

uint64_t ws_manifest_bytes(const ws_manifest *manifest) {
  return manifest->bytes;
}

void ws_manifest_free(ws_manifest *manifest) {
  if (manifest == NULL)
    return;
  EVP_MD_CTX_free(manifest->digest);
  free(manifest);
}
