#include "shm.h"

#include "digest.h"
#include "status.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

struct ws_shm {
  void *data;
  size_t size;
  int owner;
  int unlinked;
  char name[WS_SHM_NAME_MAX];
};

static const char *shm_label(const ws_shm *shm) {
  return shm->name[0] != '\0' ? shm->name : "an anonymous buffer";
}

// Maps the whole segment with its page tables filled in (MAP_POPULATE): the
// data path copies every byte of a packed buffer, and one fault per page on
// the first publication costs more than the copy itself.
static int map_segment(ws_shm *shm, int fd) {
  shm->data = mmap(NULL, shm->size, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_POPULATE, fd, 0);
  if (shm->data == MAP_FAILED) {
    shm->data = NULL;
    return ws_fail(WS_ESYS, "shm: mmap %s (%zu bytes): %s", shm->name,
                   shm->size, strerror(errno));
  }
  return WS_OK;
}

// Begins a constructor: a new buffer object of `size` bytes that this process
// owns, not mapped yet.
static int new_owned(size_t size, ws_shm **out) {
  ws_clear_error();
  if (size == 0)
    return ws_fail(WS_EINVAL, "shm: size must be positive");
  ws_shm *shm = calloc(1, sizeof *shm);
  if (shm == NULL)
    return ws_fail(WS_ENOMEM, "shm: cannot allocate");
  shm->size = size;
  shm->owner = 1;
  *out = shm;
  return WS_OK;
}

int ws_shm_create(size_t size, ws_shm **out) {
  ws_shm *shm = NULL;
  int status = new_owned(size, &shm);
  if (status != WS_OK)
    return status;
  unsigned char random_bytes[8];
  if (getrandom(random_bytes, sizeof random_bytes, 0) !=
      (ssize_t)sizeof random_bytes) {
    free(shm);
    return ws_fail(WS_ESYS, "shm: getrandom: %s", strerror(errno));
  }
  char random_hex[2 * sizeof random_bytes + 1];
  ws_hex_encode(random_bytes, sizeof random_bytes, random_hex);
  snprintf(shm->name, sizeof shm->name, "/wsync-%ld-%s", (long)getpid(),
           random_hex);

  int fd = shm_open(shm->name, O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    status = ws_fail(WS_ESYS, "shm: shm_open %s: %s", shm->name,
                     strerror(errno));
    free(shm);
    return status;
  }
  int error = posix_fallocate(fd, 0, (off_t)size);
  if (error != 0)
    status = ws_fail(WS_ESYS, "shm: cannot reserve %zu bytes for %s: %s",
                     size, shm->name, strerror(error));
  if (status == WS_OK)
    status = map_segment(shm, fd);
  close(fd);
  if (status != WS_OK) {
    shm_unlink(shm->name);
    free(shm);
    return status;
  }
  *out = shm;
  return WS_OK;
}

static int valid_name(const char *name) {
  size_t length = strnlen(name, WS_SHM_NAME_MAX);
  return length > 1 && length < WS_SHM_NAME_MAX && name[0] == '/' &&
         strchr(name + 1, '/') == NULL;
}

int ws_shm_create_anonymous(size_t size, ws_shm **out) {
  ws_shm *shm = NULL;
  int status = new_owned(size, &shm);
  if (status != WS_OK)
    return status;
  shm->unlinked = 1; // nothing to unlink
  shm->data = mmap(NULL, size, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (shm->data == MAP_FAILED) {
    status = ws_fail(WS_ENOMEM, "shm: cannot map %zu anonymous bytes: %s",
                     size, strerror(errno));
    free(shm);
    return status;
  }
  *out = shm;
  return WS_OK;
}

int ws_shm_open(const char *name, ws_shm **out) {
  ws_clear_error();
  if (!valid_name(name))
    return ws_fail(WS_EINVAL,
                   "shm: '%s' is not a segment name ('/name', under %d bytes)",
                   name, WS_SHM_NAME_MAX);
  ws_shm *shm = calloc(1, sizeof *shm);
  if (shm == NULL)
    return ws_fail(WS_ENOMEM, "shm: cannot allocate");
  snprintf(shm->name, sizeof shm->name, "%s", name);

  int fd = shm_open(name, O_RDWR, 0);
  if (fd < 0) {
    int status = ws_fail(errno == ENOENT ? WS_ENOTFOUND : WS_ESYS,
                         "shm: shm_open %s: %s", name, strerror(errno));
    free(shm);
    return status;
  }
  struct stat info;
  int status = WS_OK;
  if (fstat(fd, &info) != 0)
    status = ws_fail(WS_ESYS, "shm: fstat %s: %s", name, strerror(errno));
  else if (info.st_size <= 0)
    status = ws_fail(WS_EINVAL, "shm: %s is empty", name);
  if (status == WS_OK) {
    shm->size = (size_t)info.st_size;
    status = map_segment(shm, fd);
  }
  close(fd);
  if (status != WS_OK) {
    free(shm);
    return status;
  }
  *out = shm;
  return WS_OK;
}

void *ws_shm_data(const ws_shm *shm) { return shm->data; }

size_t ws_shm_size(const ws_shm *shm) { return shm->size; }

const char *ws_shm_name(const ws_shm *shm) { return shm->name; }

int ws_shm_is_owner(const ws_shm *shm) { return shm->owner; }

static int check_range(const ws_shm *shm, size_t offset, size_t length,
                       const char *role) {
  if (offset > shm->size || length > shm->size - offset)
    return ws_fail(WS_EINVAL,
                   "shm: %s range [%zu, %zu + %zu) exceeds the %zu-byte buffer",
                   role, offset, offset, length, shm->size);
  return WS_OK;
}

int ws_shm_copy(ws_shm *target, size_t target_offset, const ws_shm *source,
                size_t source_offset, size_t length) {
  ws_clear_error();
  int status = check_range(target, target_offset, length, "target");
  if (status == WS_OK)
    status = check_range(source, source_offset, length, "source");
  if (status != WS_OK)
    return status;
  if (target == source && target_offset < source_offset + length &&
      source_offset < target_offset + length)
    return ws_fail(WS_EINVAL, "shm: overlapping copy inside %s", shm_label(target));
  memcpy((char *)target->data + target_offset,
         (const char *)source->data + source_offset, length);
  return WS_OK;
}

int ws_shm_sha256(const ws_shm *shm, size_t offset, size_t length,
                  char *hex_out) {
  ws_clear_error();
  int status = check_range(shm, offset, length, "digest");
  if (status != WS_OK)
    return status;
  return ws_sha256_hex((const char *)shm->data + offset, length, hex_out);
}

// Removes the name once; shared by unlink and close, which clear the detail.
static int unlink_name(ws_shm *shm) {
  if (shm->unlinked)
    return WS_OK;
  shm->unlinked = 1;
  if (shm_unlink(shm->name) != 0)
    return ws_fail(errno == ENOENT ? WS_ENOTFOUND : WS_ESYS,
                   "shm: shm_unlink %s: %s", shm->name, strerror(errno));
  return WS_OK;
}

int ws_shm_unlink(ws_shm *shm) {
  ws_clear_error();
  return unlink_name(shm);
}

int ws_shm_close(ws_shm *shm) {
  ws_clear_error();
  if (shm == NULL)
    return WS_OK;
  int status = WS_OK;
  if (shm->data != NULL && munmap(shm->data, shm->size) != 0)
    status = ws_fail(WS_ESYS, "shm: munmap %s: %s", shm_label(shm),
                     strerror(errno));
  if (shm->owner && !shm->unlinked) {
    int unlink_status = unlink_name(shm);
    if (status == WS_OK)
      status = unlink_status;
  }
  free(shm);
  return status;
}
