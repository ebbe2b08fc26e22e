// A trainer rank written in C on libwsync's agent API: it opens its own wsync
// host, holds its FSDP shard of the tiny Qwen3-MoE in the transformers-v5
// layout (computed here from the config, as a trainer knows its parameters),
// registers the shards and four memory callbacks, and publishes VERSIONS model
// versions to a host started with `wsync run` on a recipe whose trainer kind is
// "external". Before publishing version v it writes wsync's synthetic values
// of version v (host/synth.h), so that the host can verify the rollout's
// resident weights.
//
// usage: agent_example ENDPOINT RANK WORLD VERSIONS [STEP_MS [FAILING [HOW]]]
//        agent_example --self-check
//
// STEP_MS is how long each training step takes before its publication (0 by
// default). FAILING names a callback that fails when the host calls it, for
// the fault tests: it returns non-zero, or with HOW "unfinished" (the actor's
// callbacks only, which confirm their end through
// ws_agent_register_confirmed_callback; the optimizer's are plain) it
// returns 0 without confirming, as a callback unwound before it ran. Prints one
// line per publication; exits 0 when every publication succeeded. SIGPIPE is at
// SIG_DFL, as in a C program, and after every wsync call the example checks
// that wsync left its signals as they were: SIGPIPE's disposition, the thread's
// mask, no SIGPIPE pending (a write to a host that died must fail the call, not
// kill it).
//
// --self-check runs what needs no wsync host (the embed tier): open failures
// and ws_last_error, registration against an endpoint that accepts and never
// answers, the synthetic values, and an agent outliving its host. Prints
// "agent_example: self-check ok" and exits 0, or says what failed and exits 1.
//
// libwsync exports only wsync.h: host/synth.c is compiled into this example.
#include <stdint.h>

#include "wsync.h"

#include "synth.h"

#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

// The tiny preset of scripts/wsync/models/qwen3_moe.lua: vocab 1000, hidden 64,
// moe_intermediate 32, 2 layers, 4 heads, 2 KV heads, head_dim 16, 4 experts,
// untied embeddings. BF16 everywhere.
enum {
  VOCAB = 1000,
  HIDDEN = 64,
  MOE_INTERMEDIATE = 32,
  LAYERS = 2,
  HEADS = 4,
  KV_HEADS = 2,
  HEAD_DIM = 16,
  EXPERTS = 4,
  ELEMENT_BYTES = 2,
  MAX_TENSORS = 3 + 11 * LAYERS,
  MAX_DIMS = 3,
};

typedef struct shard {
  char name[96];
  int64_t shape[MAX_DIMS];
  int dims;
  int64_t first_row, row_count; // this rank's rows of dim 0
  int64_t row_elements;
  size_t offset, bytes; // where the rows live in the rank's memory
} shard;

typedef struct layout {
  shard tensors[MAX_TENSORS];
  int count;
  size_t bytes;
} layout;

// Adds a tensor and this rank's dim-0 rows as torch.chunk splits them: chunks
// of ceil(rows / world), the last ones shorter or empty.
static void add_tensor(layout *out, int rank, int world, const char *name,
                       int dims, int64_t d0, int64_t d1, int64_t d2) {
  shard *tensor = &out->tensors[out->count++];
  snprintf(tensor->name, sizeof tensor->name, "%s", name);
  int64_t shape[MAX_DIMS] = {d0, d1, d2};
  tensor->dims = dims;
  tensor->row_elements = 1;
  for (int d = 0; d < dims; d++) {
    tensor->shape[d] = shape[d];
    if (d > 0)
      tensor->row_elements *= shape[d];
  }
  int64_t chunk = (d0 + world - 1) / world;
  int64_t first = rank * chunk < d0 ? rank * chunk : d0;
  tensor->first_row = first;
  tensor->row_count = d0 - first < chunk ? d0 - first : chunk;
  tensor->offset = out->bytes;
  tensor->bytes =
      (size_t)(tensor->row_count * tensor->row_elements) * ELEMENT_BYTES;
  out->bytes += tensor->bytes;
}

// The trainer layout in wsync's order (qwen3_moe.lua trainer_layout): 25
// tensors for the tiny model.
static void build_layout(layout *out, int rank, int world) {
  memset(out, 0, sizeof *out);
  char name[96];
  add_tensor(out, rank, world, "model.embed_tokens.weight", 2, VOCAB, HIDDEN,
             0);
  for (int l = 0; l < LAYERS; l++) {
#define LAYER_TENSOR(suffix, dims, d0, d1, d2)                                 \
  snprintf(name, sizeof name, "model.layers.%d.%s", l, suffix);                \
  add_tensor(out, rank, world, name, dims, d0, d1, d2)
    LAYER_TENSOR("self_attn.q_proj.weight", 2, HEADS * HEAD_DIM, HIDDEN, 0);
    LAYER_TENSOR("self_attn.k_proj.weight", 2, KV_HEADS * HEAD_DIM, HIDDEN, 0);
    LAYER_TENSOR("self_attn.v_proj.weight", 2, KV_HEADS * HEAD_DIM, HIDDEN, 0);
    LAYER_TENSOR("self_attn.o_proj.weight", 2, HIDDEN, HEADS * HEAD_DIM, 0);
    LAYER_TENSOR("self_attn.q_norm.weight", 1, HEAD_DIM, 0, 0);
    LAYER_TENSOR("self_attn.k_norm.weight", 1, HEAD_DIM, 0, 0);
    LAYER_TENSOR("mlp.gate.weight", 2, EXPERTS, HIDDEN, 0);
    LAYER_TENSOR("mlp.experts.gate_up_proj", 3, EXPERTS, 2 * MOE_INTERMEDIATE,
                 HIDDEN);
    LAYER_TENSOR("mlp.experts.down_proj", 3, EXPERTS, HIDDEN, MOE_INTERMEDIATE);
    LAYER_TENSOR("input_layernorm.weight", 1, HIDDEN, 0, 0);
    LAYER_TENSOR("post_attention_layernorm.weight", 1, HIDDEN, 0, 0);
#undef LAYER_TENSOR
  }
  add_tensor(out, rank, world, "model.norm.weight", 1, HIDDEN, 0, 0);
  add_tensor(out, rank, world, "lm_head.weight", 2, VOCAB, HIDDEN, 0);
}

// The optimizer step of this synthetic trainer: every shard takes version
// `version`'s values.
static int fill_version(const layout *shards, unsigned char *memory,
                        uint32_t version) {
  for (int i = 0; i < shards->count; i++) {
    const shard *tensor = &shards->tensors[i];
    if (tensor->row_count == 0)
      continue;
    uint64_t seed = ws_synth_seed(tensor->name, strlen(tensor->name));
    if (ws_synth_fill(memory + tensor->offset, WS_DTYPE_BFLOAT16, seed,
                      (uint64_t)(tensor->first_row * tensor->row_elements),
                      (uint64_t)(tensor->row_count * tensor->row_elements),
                      version) != 0)
      return -1;
  }
  return 0;
}

// The signal state a C trainer owns, which wsync must not change: SIGPIPE's
// disposition and the thread's signal mask.
typedef struct signal_state {
  struct sigaction sigpipe;
  sigset_t mask;
} signal_state;

static void read_signal_state(signal_state *out) {
  sigaction(SIGPIPE, NULL, &out->sigpipe);
  pthread_sigmask(SIG_SETMASK, NULL, &out->mask);
}

// Returns 0 when the signal state is still `before` and no SIGPIPE is
// pending; otherwise says what changed after `call` and returns -1.
static int check_signals(const signal_state *before, const char *call) {
  signal_state now;
  read_signal_state(&now);
  sigset_t pending;
  sigpending(&pending);
  const char *changed = NULL;
  if (now.sigpipe.sa_handler != before->sigpipe.sa_handler)
    changed = "SIGPIPE's disposition changed";
  else if (sigismember(&pending, SIGPIPE))
    changed = "a SIGPIPE is pending";
  for (int number = 1; changed == NULL && number < NSIG; number++)
    if (sigismember(&now.mask, number) != sigismember(&before->mask, number))
      changed = "the thread's signal mask changed";
  if (changed == NULL)
    return 0;
  fprintf(stderr, "agent_example: after %s: %s\n", call, changed);
  return -1;
}

// Memory callbacks: each moves one part between resident and offloaded and
// refuses a transition that makes no sense.
enum { RESIDENT, OFFLOADED };

typedef struct trainer {
  int rank;
  int actor, optimizer;
  const char *failing; // the callback that fails on purpose, or NULL
  int unfinished;      // it fails by not confirming its end
  ws_host *host;
  ws_agent *agent;
} trainer;

typedef struct transition {
  const char *name;
  trainer *owner;
  int *part;
  int from, to;
} transition;

static int run_transition(void *user_data) {
  transition *step = user_data;
  trainer *owner = step->owner;
  if (owner->failing != NULL && strcmp(owner->failing, step->name) == 0 &&
      !owner->unfinished) {
    fprintf(stderr, "agent_example rank %d: %s fails on purpose\n", owner->rank,
            step->name);
    return 1;
  }
  // A callback runs inside the agent's own call: wsync refuses to nest,
  // and a host closed from here would stay open.
  ws_host_close(owner->host);
  if (ws_agent_ready(owner->agent) != WS_ESTATE ||
      ws_host_run_string(owner->host, "return 1", "=(nested)") != WS_ESTATE) {
    fprintf(stderr,
            "agent_example rank %d: a nested wsync call was not "
            "refused\n",
            owner->rank);
    return 3;
  }
  if (*step->part != step->from) {
    fprintf(stderr, "agent_example rank %d: %s in the wrong state\n",
            owner->rank, step->name);
    return 2;
  }
  *step->part = step->to;
  return 0;
}

// run_transition as a confirmed callback: `*done` is set once it ran to its
// end, which the unfinished failing callback never does.
static int run_confirmed_transition(void *user_data, int *done) {
  transition *step = user_data;
  trainer *owner = step->owner;
  if (owner->failing != NULL && strcmp(owner->failing, step->name) == 0 &&
      owner->unfinished) {
    fprintf(stderr, "agent_example rank %d: %s does not finish on purpose\n",
            owner->rank, step->name);
    return 0;
  }
  int status = run_transition(user_data);
  *done = 1;
  return status;
}

// A thread's failed open: its own ws_last_error, not the caller's.
static void *fail_open_on_a_thread(void *text_out) {
  ws_agent *agent = NULL;
  ws_agent_open(NULL, "unused", 0, 1, NULL, -1, &agent);
  snprintf(text_out, 128, "%s", ws_last_error());
  return NULL;
}

static int refuse_step(void *user_data) {
  (void)user_data;
  return 1;
}

// Fails the self-check with a message when `ok` is false.
#define SELF_CHECK(ok, ...)                                                    \
  do {                                                                         \
    if (!(ok)) {                                                               \
      fprintf(stderr, "agent_example self-check: " __VA_ARGS__);               \
      fprintf(stderr, "\n");                                                   \
      goto done;                                                               \
    }                                                                          \
  } while (0)

// What the agent API does without a wsync host: see the usage above.
static int self_check(void) {
  static layout shards;
  build_layout(&shards, 0, 1);
  unsigned char *memory = calloc(1, shards.bytes);
  char directory[] = "/tmp/wsync-agent-example-XXXXXX";
  char endpoint[sizeof directory + 16] = "";
  int listener = -1;
  ws_host *host = NULL;
  ws_agent *agent = NULL;
  int failed = 1;
  SELF_CHECK(memory != NULL, "cannot allocate %zu bytes", shards.bytes);

  // Why an open failed, before there is a host to ask and after.
  SELF_CHECK(ws_host_open(NULL) != 0 &&
                 strstr(ws_last_error(), "ws_host_open") != NULL,
             "ws_host_open(NULL): ws_last_error() = \"%s\"", ws_last_error());
  signal_state signals;
  signal(SIGPIPE, SIG_DFL);
  read_signal_state(&signals);
  SELF_CHECK(ws_host_open(&host) == 0 && ws_last_error()[0] == '\0',
             "ws_host_open: ws_last_error() = \"%s\"", ws_last_error());
  SELF_CHECK(check_signals(&signals, "ws_host_open") == 0,
             "the host took over the process's signals");
  SELF_CHECK(ws_agent_open(host, "/nonexistent/control.sock", 0, 1, "host", 0,
                           &agent) == WS_EFAILED &&
                 agent == NULL &&
                 strstr(ws_last_error(), "cannot connect to "
                                         "/nonexistent/control.sock") != NULL,
             "a missing endpoint: ws_last_error() = \"%s\"", ws_last_error());
  SELF_CHECK(
      ws_agent_open(host, "unused", 2, 2, NULL, -1, &agent) == WS_EINVAL &&
          strstr(ws_last_error(), "0 <= rank < world (rank 2, world 2)") !=
              NULL &&
          strcmp(ws_last_error(), ws_host_error(host)) == 0,
      "rank 2 of 2: ws_last_error() = \"%s\"", ws_last_error());
  char thread_text[128] = "";
  pthread_t thread;
  SELF_CHECK(
      pthread_create(&thread, NULL, fail_open_on_a_thread, thread_text) == 0 &&
          pthread_join(thread, NULL) == 0,
      "cannot run a thread");
  SELF_CHECK(strstr(thread_text, "host and out are required") != NULL &&
                 strstr(ws_last_error(), "rank 2, world 2") != NULL,
             "ws_last_error is not per thread: \"%s\" on the thread, \"%s\" "
             "here",
             thread_text, ws_last_error());

  // An endpoint that accepts connections (the kernel's backlog) and never
  // answers: opening and registering need no reply.
  SELF_CHECK(mkdtemp(directory) != NULL, "mkdtemp failed");
  snprintf(endpoint, sizeof endpoint, "%s/control.sock", directory);
  struct sockaddr_un address = {.sun_family = AF_UNIX};
  snprintf(address.sun_path, sizeof address.sun_path, "%s", endpoint);
  listener = socket(AF_UNIX, SOCK_STREAM, 0);
  SELF_CHECK(listener >= 0 &&
                 bind(listener, (struct sockaddr *)&address, sizeof address) ==
                     0 &&
                 listen(listener, 4) == 0,
             "cannot listen on %s", endpoint);
  SELF_CHECK(ws_agent_open(host, endpoint, 0, 1, "host", 0, &agent) == 0 &&
                 ws_last_error()[0] == '\0',
             "open: %s", ws_last_error());
  for (int i = 0; i < shards.count; i++) {
    const shard *tensor = &shards.tensors[i];
    SELF_CHECK(ws_agent_register_tensor(
                   agent, tensor->name, "bfloat16", tensor->shape, tensor->dims,
                   memory + tensor->offset, tensor->bytes, tensor->first_row,
                   tensor->row_count) == 0,
               "%s", ws_agent_error(agent));
  }
  SELF_CHECK(ws_agent_register_callback(agent, "offload_actor", refuse_step,
                                        NULL) == 0,
             "%s", ws_agent_error(agent));
  // Storage that moved: a tensor's new place, checked against its rows.
  const shard *first = &shards.tensors[0];
  SELF_CHECK(ws_agent_set_tensor_data(agent, "no.such.tensor", memory, 16) ==
                     WS_EINVAL &&
                 strstr(ws_agent_error(agent),
                        "no tensor no.such.tensor is registered") != NULL,
             "set_tensor_data of an unknown name: %s", ws_agent_error(agent));
  SELF_CHECK(ws_agent_set_tensor_data(agent, first->name,
                                      memory + first->offset,
                                      first->bytes - 2) == WS_EINVAL &&
                 strstr(ws_agent_error(agent), "bytes do not hold its") !=
                     NULL,
             "set_tensor_data with too few bytes: %s", ws_agent_error(agent));
  SELF_CHECK(ws_agent_set_tensor_data(agent, first->name, NULL, 0) == 0 &&
                 ws_agent_set_tensor_data(agent, first->name,
                                          memory + first->offset,
                                          first->bytes) == 0,
             "set_tensor_data: %s", ws_agent_error(agent));
  // What a callback moved: a count the host's run report can hold exactly
  // (outside a callback it is forgotten).
  SELF_CHECK(ws_agent_report_moved(agent, (1ULL << 53) + 1) == WS_EINVAL &&
                 strstr(ws_agent_error(agent), "bytes above 2^53") != NULL,
             "report_moved above 2^53: %s", ws_agent_error(agent));
  SELF_CHECK(ws_agent_report_moved(agent, 4096) == 0, "report_moved: %s",
             ws_agent_error(agent));
  SELF_CHECK(fill_version(&shards, memory, 1) == 0, "ws_synth_fill failed");

  // The agent outlives its host: every call but close is refused, and close
  // only frees it.
  ws_host_close(host);
  host = NULL;
  SELF_CHECK(check_signals(&signals, "ws_host_close") == 0,
             "the host left the process's signals changed");
  SELF_CHECK(ws_agent_ready(agent) == WS_ESTATE &&
                 strstr(ws_agent_error(agent), "ws_agent_ready: the agent's "
                                               "host was closed") != NULL,
             "ready after the host closed: %s", ws_agent_error(agent));
  SELF_CHECK(ws_agent_report_moved(agent, 1) == WS_ESTATE &&
                 strstr(ws_agent_error(agent), "ws_agent_report_moved: the "
                                               "agent's host was closed") !=
                     NULL,
             "report_moved after the host closed: %s", ws_agent_error(agent));
  SELF_CHECK(ws_agent_publish(agent, 1, NULL) == WS_ESTATE,
             "publish after the host closed: %s", ws_agent_error(agent));
  SELF_CHECK(ws_agent_set_tensor_data(agent, first->name, memory, 16) ==
                 WS_ESTATE,
             "set_tensor_data after the host closed: %s",
             ws_agent_error(agent));
  ws_agent_close(agent);
  agent = NULL;
  printf("agent_example: self-check ok (%d tensors registered, %zu bytes)\n",
         shards.count, shards.bytes);
  failed = 0;
done:
  ws_agent_close(agent);
  ws_host_close(host);
  if (listener >= 0)
    close(listener);
  if (endpoint[0] != '\0')
    unlink(endpoint);
  rmdir(directory);
  free(memory);
  return failed;
}

int main(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[1], "--self-check") == 0)
    return self_check();
  if (argc < 5 || argc > 8 ||
      (argc == 8 && strcmp(argv[7], "unfinished") != 0)) {
    fprintf(stderr, "usage: agent_example ENDPOINT RANK WORLD VERSIONS "
                    "[STEP_MS [FAILING [unfinished]]]\n"
                    "       agent_example --self-check\n");
    return 2;
  }
  const char *endpoint = argv[1];
  int rank = atoi(argv[2]), world = atoi(argv[3]), versions = atoi(argv[4]);
  long step_ms = argc >= 6 ? atol(argv[5]) : 0;
  trainer state = {rank,
                   RESIDENT,
                   RESIDENT,
                   argc >= 7 ? argv[6] : NULL,
                   argc == 8,
                   NULL,
                   NULL};
  transition steps[] = {
      {"offload_optimizer", &state, &state.optimizer, RESIDENT, OFFLOADED},
      {"onload_optimizer", &state, &state.optimizer, OFFLOADED, RESIDENT},
      {"offload_actor", &state, &state.actor, RESIDENT, OFFLOADED},
      {"onload_actor", &state, &state.actor, OFFLOADED, RESIDENT},
  };

  static layout shards;
  build_layout(&shards, rank, world);
  unsigned char *memory = calloc(1, shards.bytes > 0 ? shards.bytes : 1);
  ws_host *host = NULL;
  ws_agent *agent = NULL;
  int failed = 1;
  signal_state signals;
  signal(SIGPIPE, SIG_DFL);
  read_signal_state(&signals);
  if (memory == NULL || ws_host_open(&host) != 0) {
    fprintf(stderr, "agent_example rank %d: cannot start: %s\n", rank,
            ws_last_error());
    goto done;
  }
  if (check_signals(&signals, "ws_host_open") != 0)
    goto done;
  if (ws_agent_open(host, endpoint, rank, world, "host", rank, &agent) != 0) {
    fprintf(stderr, "agent_example rank %d: open: %s\n", rank, ws_last_error());
    goto done;
  }
  state.host = host;
  state.agent = agent;
  for (int i = 0; i < shards.count; i++) {
    const shard *tensor = &shards.tensors[i];
    if (ws_agent_register_tensor(agent, tensor->name, "bfloat16", tensor->shape,
                                 tensor->dims, memory + tensor->offset,
                                 tensor->bytes, tensor->first_row,
                                 tensor->row_count) != 0) {
      fprintf(stderr, "agent_example rank %d: %s\n", rank,
              ws_agent_error(agent));
      goto done;
    }
  }
  // The optimizer's callbacks are plain, the actor's confirm their end.
  for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
    int status =
        steps[i].part == &state.actor
            ? ws_agent_register_confirmed_callback(
                  agent, steps[i].name, run_confirmed_transition, &steps[i])
            : ws_agent_register_callback(agent, steps[i].name, run_transition,
                                         &steps[i]);
    if (status != 0) {
      fprintf(stderr, "agent_example rank %d: %s\n", rank,
              ws_agent_error(agent));
      goto done;
    }
  }
  if (ws_agent_ready(agent) != 0) {
    fprintf(stderr, "agent_example rank %d: ready: %s\n", rank,
            ws_agent_error(agent));
    goto done;
  }
  if (check_signals(&signals, "ws_agent_ready") != 0)
    goto done;
  // The host stays usable between agent calls: the connection does not keep
  // its loop running.
  if (ws_host_run_string(host, "assert(require('wsync').version)",
                         "=(agent_example)") != 0) {
    fprintf(stderr, "agent_example rank %d: host: %s\n", rank,
            ws_host_error(host));
    goto done;
  }
  printf("agent_example rank %d: registered %d tensors (%zu bytes)\n", rank,
         shards.count, shards.bytes);
  fflush(stdout);
  for (int version = 1; version <= versions; version++) {
    // The training step; wsync's loop does not run meanwhile.
    struct timespec step_time = {step_ms / 1000, (step_ms % 1000) * 1000000};
    nanosleep(&step_time, NULL);
    if (fill_version(&shards, memory, (uint32_t)version) != 0) {
      fprintf(stderr, "agent_example rank %d: ws_synth_fill failed\n", rank);
      goto done;
    }
    ws_publish_result result;
    int status = ws_agent_publish(agent, version, &result);
    if (check_signals(&signals, "ws_agent_publish") != 0)
      goto done;
    if (status != 0) {
      printf("agent_example rank %d: publish %d failed (status %d): %s\n", rank,
             version, status, ws_agent_error(agent));
      fflush(stdout);
      goto done;
    }
    printf("agent_example rank %d: published version %d: model version "
           "%" PRId64 ", publication %s, manifest %s, receipts %d\n",
           rank, version, result.model_version, result.publication_id,
           result.manifest, result.receipts);
    fflush(stdout);
    if (state.actor != RESIDENT || state.optimizer != RESIDENT) {
      fprintf(stderr,
              "agent_example rank %d: the schedule left the actor or "
              "the optimizer offloaded\n",
              rank);
      goto done;
    }
  }
  // Closing the host before its agent also works: the agent is detached, its
  // calls fail with WS_ESTATE, and ws_agent_close only frees it.
  ws_host_close(host);
  host = NULL;
  if (ws_agent_ready(agent) != WS_ESTATE ||
      strstr(ws_agent_error(agent), "host was closed") == NULL) {
    fprintf(stderr, "agent_example rank %d: an agent of a closed host: %s\n",
            rank, ws_agent_error(agent));
    goto done;
  }
  failed = 0;
done:
  ws_agent_close(agent);
  ws_host_close(host);
  free(memory);
  return failed;
}
