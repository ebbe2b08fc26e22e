// Unix-socket peer checks for the agent control endpoint.
#pragma once

#include "status_defs.h"

/// Stores the user id of the process at the other end of the connected unix
/// socket `fd` (SO_PEERCRED) in `*uid`, and its process id in `*pid`.
int ws_socket_peer(int fd, unsigned *uid, int *pid);

/// Returns this process's effective user id.
unsigned ws_socket_own_uid(void);
