// Embeds wsync through libwsync: opens a host, runs a chunk and a recipe,
// checks that a failing chunk reports its error, and closes the host.

#include "wsync.h"

#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: embed_example RECIPE\n");
    return 2;
  }
  ws_host *host = NULL;
  if (ws_host_open(&host) != 0) {
    fprintf(stderr, "embed_example: ws_host_open failed\n");
    return 1;
  }
  int failures = 0;
  if (ws_host_run_string(host, "assert(require('wsync').version == ...)",
                         "=(embed)") == 0) {
    fprintf(stderr, "embed_example: a failing chunk reported success\n");
    failures++;
  } else if (strstr(ws_host_error(host), "assertion failed") == NULL) {
    fprintf(stderr, "embed_example: unexpected error: %s\n",
            ws_host_error(host));
    failures++;
  }
  if (ws_host_run_string(host, "_G.embedded_answer = 6 * 7", "=(embed)") != 0 ||
      ws_host_run_string(host, "assert(embedded_answer == 42)", "=(embed)") !=
          0) {
    fprintf(stderr, "embed_example: %s\n", ws_host_error(host));
    failures++;
  }
  const char *overrides[] = {"greeting=embedded"};
  if (ws_host_run_recipe(host, argv[1], 1, overrides) != 0) {
    fprintf(stderr, "embed_example: recipe failed: %s\n", ws_host_error(host));
    failures++;
  }
  ws_host_close(host);
  printf("embed_example: %s (wsync %s)\n", failures ? "FAILED" : "ok",
         ws_version());
  return failures ? 1 : 0;
}
