#include "process.h"

#include "status.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

int ws_process_become_subreaper(void) {
  ws_clear_error();
  if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0)
    return ws_fail(WS_ESYS, "process: PR_SET_CHILD_SUBREAPER: %s",
                   strerror(errno));
  return WS_OK;
}

int ws_process_die_with_parent(int signal_number, int expected_parent) {
  ws_clear_error();
  pid_t parent = expected_parent > 0 ? (pid_t)expected_parent : getppid();
  if (prctl(PR_SET_PDEATHSIG, signal_number, 0, 0, 0) != 0)
    return ws_fail(WS_ESYS, "process: PR_SET_PDEATHSIG: %s", strerror(errno));
  // The parent may have died before prctl took effect: this process was then
  // reparented (to init or a subreaper) and no signal will come.
  if (getppid() != parent)
    return ws_fail(WS_ESTATE, "process: the parent process (%d) is already gone",
                   (int)parent);
  return WS_OK;
}

int ws_process_signal_group(int group, int signal_number) {
  ws_clear_error();
  if (group <= 1)
    return ws_fail(WS_EINVAL, "process: refusing to signal group %d", group);
  if (kill(-(pid_t)group, signal_number) != 0 && errno != ESRCH)
    return ws_fail(WS_ESYS, "process: kill(-%d, %d): %s", group,
                   signal_number, strerror(errno));
  return WS_OK;
}

int ws_process_reap_group(int group, int *reaped) {
  ws_clear_error();
  *reaped = 0;
  if (group <= 1)
    return ws_fail(WS_EINVAL, "process: refusing to reap group %d", group);
  for (;;) {
    pid_t pid = waitpid(-(pid_t)group, NULL, WNOHANG);
    if (pid > 0) {
      (*reaped)++;
      continue;
    }
    if (pid == 0 || errno == ECHILD)
      return WS_OK;
    if (errno != EINTR)
      return ws_fail(WS_ESYS, "process: waitpid(-%d): %s", group,
                     strerror(errno));
  }
}

// Reads the process group from /proc/PID/stat: the fifth field, after the
// command name in parentheses (which may itself hold spaces and parentheses).
static int read_group(const char *pid, int *group) {
  char path[64], line[512];
  snprintf(path, sizeof path, "/proc/%s/stat", pid);
  FILE *file = fopen(path, "r");
  if (file == NULL)
    return 0;
  int found = fgets(line, sizeof line, file) != NULL;
  fclose(file);
  if (!found)
    return 0;
  char *end = strrchr(line, ')');
  if (end == NULL)
    return 0;
  char state = 0;
  int parent = 0;
  return sscanf(end + 1, " %c %d %d", &state, &parent, group) == 3;
}

int ws_process_count_group(int group, int *count) {
  ws_clear_error();
  *count = 0;
  DIR *proc = opendir("/proc");
  if (proc == NULL)
    return ws_fail(WS_ESYS, "process: opendir /proc: %s", strerror(errno));
  struct dirent *entry;
  while ((entry = readdir(proc)) != NULL) {
    if (!isdigit((unsigned char)entry->d_name[0]))
      continue;
    int member_group = 0;
    if (read_group(entry->d_name, &member_group) && member_group == group)
      (*count)++;
  }
  closedir(proc);
  return WS_OK;
}
