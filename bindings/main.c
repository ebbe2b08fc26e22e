// The `wsync` command: opens a host, hands the command line to wsync.cli, and
// closes the host before returning its exit code.

#include "status.h"
#include "wsync.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

// Opens /dev/null on any of fds 0, 1, 2 that the caller closed, so that the
// loop's own descriptors never take their numbers (libuv then treats them as
// stdio and aborts when a handle on them closes).
static void reserve_standard_fds(void) {
  for (int fd = 0; fd <= 2; fd++) {
    if (fcntl(fd, F_GETFD) == -1) {
      int opened = open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
      if (opened >= 0 && opened != fd) {
        dup2(opened, fd);
        close(opened);
      }
    }
  }
}

int main(int argc, char **argv) {
  reserve_standard_fds();
  // This process is wsync's own: a write to a reader that left (a runtime
  // that died, `wsync ... | head`) fails with EPIPE instead of killing it,
  // in every thread. (libwsync itself leaves its embedder's dispositions
  // alone and only blocks SIGPIPE while its code runs.)
  signal(SIGPIPE, SIG_IGN);
  // Whole lines, each written at once, also into a pipe or a file: the
  // processes of a run (the host, its trainer ranks, the runtime and its
  // workers) share them, and a block-buffered line would be cut by another
  // process's.
  setvbuf(stdout, NULL, _IOLBF, 0);
  setvbuf(stderr, NULL, _IOLBF, 0);
  ws_host *host = NULL;
  int status = ws_host_open(&host);
  if (status != WS_OK) {
    fprintf(stderr, "wsync: cannot start: %s\n", ws_last_error());
    return 1;
  }
  int exit_code = ws_host_main(host, argc - 1, (const char *const *)argv + 1);
  ws_host_close(host);
  fflush(stdout);
  return exit_code;
}
