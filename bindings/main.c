// The `wsync` command: opens a host, hands the command line to wsync.cli, and
// closes the host before returning its exit code.
#include "status.h"
#include "wsync.h"

#include <stdio.h>

int main(int argc, char **argv) {
  ws_host *host = NULL;
  int status = ws_host_open(&host);
  if (status != WS_OK) {
    fprintf(stderr, "wsync: cannot start: %s\n", ws_error_detail());
    return 1;
  }
  int exit_code = ws_host_main(host, argc - 1, (const char *const *)argv + 1);
  ws_host_close(host);
  fflush(stdout);
  return exit_code;
}
