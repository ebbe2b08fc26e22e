#include "process.h"

#include "status.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

int ws_process_set_subreaper(int enabled) {
  ws_clear_error();
  if (prctl(PR_SET_CHILD_SUBREAPER, enabled ? 1 : 0, 0, 0, 0) != 0)
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

// waitpid(`target`, WNOHANG), again when a signal interrupted it.
static pid_t wait_without_blocking(pid_t target) {
  pid_t got;
  do
    got = waitpid(target, NULL, WNOHANG);
  while (got < 0 && errno == EINTR);
  return got;
}

int ws_process_reap_group(int group, int *reaped) {
  ws_clear_error();
  *reaped = 0;
  if (group <= 1)
    return ws_fail(WS_EINVAL, "process: refusing to reap group %d", group);
  pid_t pid;
  while ((pid = wait_without_blocking(-(pid_t)group)) > 0)
    (*reaped)++;
  if (pid == 0 || errno == ECHILD)
    return WS_OK;
  return ws_fail(WS_ESYS, "process: waitpid(-%d): %s", group, strerror(errno));
}

// Reads the state, parent, process group and session from /proc/PID/stat:
// the third to sixth fields, after the command name in parentheses (which
// may itself hold spaces and parentheses).
static int read_stat(const char *pid, char *state, int *parent, int *group,
                     int *session) {
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
  return sscanf(end + 1, " %c %d %d %d", state, parent, group, session) == 4;
}

// One process as its /proc/PID/stat shows it.
struct process_entry {
  int pid;
  char state;
  int parent, group, session;
};

// Calls `visit` with `context` and each process in /proc whose stat can be
// read (one gone by then is passed over).
static int each_process(void (*visit)(void *context,
                                      const struct process_entry *process),
                        void *context) {
  DIR *proc = opendir("/proc");
  if (proc == NULL)
    return ws_fail(WS_ESYS, "process: opendir /proc: %s", strerror(errno));
  struct dirent *item;
  while ((item = readdir(proc)) != NULL) {
    struct process_entry process = {0};
    if (isdigit((unsigned char)item->d_name[0]) &&
        read_stat(item->d_name, &process.state, &process.parent,
                  &process.group, &process.session)) {
      process.pid = atoi(item->d_name);
      visit(context, &process);
    }
  }
  closedir(proc);
  return WS_OK;
}

// What a listing found: up to `capacity` pids (and, when `exited` is not
// NULL, whether each is a zombie), and how many there are in `*count`.
struct found_pids {
  int *pids;
  int *exited;
  int capacity;
  int *count;
};

static void add_found(struct found_pids *found,
                      const struct process_entry *process) {
  if (*found->count < found->capacity) {
    found->pids[*found->count] = process->pid;
    if (found->exited != NULL)
      found->exited[*found->count] = process->state == 'Z';
  }
  (*found->count)++;
}

struct group_count {
  int group;
  int *count;
};

static void count_member(void *context, const struct process_entry *process) {
  struct group_count *counting = context;
  if (process->group == counting->group)
    (*counting->count)++;
}

int ws_process_count_group(int group, int *count) {
  ws_clear_error();
  *count = 0;
  struct group_count counting = {group, count};
  return each_process(count_member, &counting);
}

struct children_search {
  struct found_pids found;
  pid_t own;
};

static void add_child(void *context, const struct process_entry *process) {
  struct children_search *search = context;
  if (process->parent == search->own)
    add_found(&search->found, process);
}

int ws_process_children(int *pids, int *exited, int capacity, int *count) {
  ws_clear_error();
  *count = 0;
  if (capacity < 0 || (capacity > 0 && pids == NULL))
    return ws_fail(WS_EINVAL, "process: children: bad capacity");
  struct children_search search = {{pids, exited, capacity, count}, getpid()};
  return each_process(add_child, &search);
}

int ws_process_reap(int pid, int *reaped) {
  ws_clear_error();
  *reaped = 0;
  if (pid <= 0)
    return ws_fail(WS_EINVAL, "process: cannot reap pid %d", pid);
  pid_t got = wait_without_blocking((pid_t)pid);
  if (got == (pid_t)pid) {
    *reaped = 1;
    return WS_OK;
  }
  if (got == 0)
    return WS_OK;
  if (errno == ECHILD)
    return ws_fail(WS_ENOTFOUND, "process: %d is no child of this process",
                   pid);
  return ws_fail(WS_ESYS, "process: waitpid(%d): %s", pid, strerror(errno));
}

int ws_process_watch(int pid, int *fd) {
  ws_clear_error();
  *fd = -1;
  if (pid <= 0)
    return ws_fail(WS_EINVAL, "process: cannot watch pid %d", pid);
#ifdef SYS_pidfd_open
  long opened = syscall(SYS_pidfd_open, (pid_t)pid, 0);
  if (opened < 0 && errno == ENOSYS)
    return ws_fail(WS_ENODEV, "process: this system has no pidfd_open (%s)",
                   strerror(errno));
  if (opened < 0)
    return ws_fail(errno == ESRCH ? WS_ENOTFOUND : WS_ESYS,
                   "process: pidfd_open(%d): %s", pid, strerror(errno));
  *fd = (int)opened;
  return WS_OK;
#else
  return ws_fail(WS_ENODEV, "process: this system has no pidfd_open");
#endif
}

// Whether the NUL-separated entries of `/proc/<pid>/environ` hold `entry`.
// The file is read whole (a process's initial environment is at most a few
// pages, and the kernel caps it with the argument limit).
static int environ_holds(int pid, const char *entry, size_t length) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/environ", pid);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return 0;
  size_t capacity = 16384, used = 0;
  char *text = malloc(capacity);
  int found = 0;
  while (text != NULL) {
    if (used == capacity) {
      char *grown = realloc(text, capacity * 2);
      if (grown == NULL)
        break;
      text = grown;
      capacity *= 2;
    }
    ssize_t got = read(fd, text + used, capacity - used);
    if (got < 0 && errno == EINTR)
      continue;
    if (got <= 0)
      break;
    used += (size_t)got;
  }
  close(fd);
  for (size_t at = 0; text != NULL && at < used && !found;) {
    const char *end = memchr(text + at, '\0', used - at);
    size_t size = end != NULL ? (size_t)(end - (text + at)) : used - at;
    found = size == length && memcmp(text + at, entry, length) == 0;
    at += size + 1;
  }
  free(text);
  return found;
}

struct mark_search {
  struct found_pids found;
  pid_t own;
  const char *entry;
  size_t length;
  const int *sessions;
  int session_count;
};

static void add_marked(void *context, const struct process_entry *process) {
  struct mark_search *search = context;
  if (process->pid == search->own || process->state == 'Z' ||
      process->state == 'X')
    return; // (this one; gone, or a zombie: it holds nothing any more)
  int in_session = 0;
  for (int i = 0; i < search->session_count && !in_session; i++)
    in_session = search->sessions[i] > 1 &&
                 process->session == search->sessions[i];
  if (in_session ||
      environ_holds(process->pid, search->entry, search->length))
    add_found(&search->found, process);
}

int ws_process_find_marked(const char *entry, const int *sessions,
                           int session_count, int *pids, int capacity,
                           int *count) {
  ws_clear_error();
  *count = 0;
  if (entry == NULL || strchr(entry, '=') == NULL)
    return ws_fail(WS_EINVAL, "process: a mark is NAME=VALUE");
  if (capacity < 0 || session_count < 0 ||
      (session_count > 0 && sessions == NULL))
    return ws_fail(WS_EINVAL, "process: find_marked: bad counts");
  struct mark_search search = {{pids, NULL, capacity, count}, getpid(), entry,
                               strlen(entry), sessions, session_count};
  return each_process(add_marked, &search);
}
