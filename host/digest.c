#include "digest.h"

#include "status.h"

#include <openssl/evp.h>

void ws_hex_encode(const unsigned char *bytes, size_t size, char *hex_out) {
  static const char hex_digits[] = "0123456789abcdef";
  for (size_t i = 0; i < size; i++) {
    hex_out[2 * i] = hex_digits[bytes[i] >> 4];
    hex_out[2 * i + 1] = hex_digits[bytes[i] & 15];
  }
  hex_out[2 * size] = '\0';
}

int ws_sha256(const void *data, size_t size, unsigned char *digest_out) {
  ws_clear_error();
  unsigned int length = 0;
  if (EVP_Digest(data, size, digest_out, &length, EVP_sha256(), NULL) != 1 ||
      length != WS_SHA256_BYTES)
    return ws_fail(WS_ECRYPTO, "SHA-256 failed");
  return WS_OK;
}

int ws_sha256_hex(const void *data, size_t size, char *hex_out) {
  unsigned char digest[WS_SHA256_BYTES];
  int status = ws_sha256(data, size, digest);
  if (status == WS_OK)
    ws_hex_encode(digest, sizeof digest, hex_out);
  return status;
}
