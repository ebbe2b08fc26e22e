#define _GNU_SOURCE
#include "socket.h"

#include "status.h"

#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int ws_socket_peer(int fd, unsigned *uid, int *pid) {
  ws_clear_error();
  struct ucred credentials;
  socklen_t length = sizeof credentials;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0)
    return ws_fail(WS_ESYS, "socket: SO_PEERCRED on fd %d: %s", fd,
                   strerror(errno));
  *uid = credentials.uid;
  *pid = credentials.pid;
  return WS_OK;
}

unsigned ws_socket_own_uid(void) { return (unsigned)geteuid(); }
