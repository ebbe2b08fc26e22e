// libFuzzer target for wsync's control protocol and recipe loader. Every input
// goes through a real wsync host (the C core, LuaJIT, luv, the scripts of the
// source tree) to run() of tests/fuzz/entry.lua, which decodes it as frames,
// feeds it to a peer or a server over a socket pair, or loads it as a recipe
// (its first byte picks which). A finding is a sanitizer report or run()
// raising: the target prints the error and aborts, so that libFuzzer keeps
// the input. A third of the mutations are the entry's own (entry.mutate: it
// knows the frames and the schemas' words).
//
// LuaJIT has no coverage instrumentation: a line hook hashes each edge between
// two lines of wsync's scripts into libFuzzer's extra counters, so that the
// fuzzer is guided by the Lua lines an input reaches. A Lua state has one hook,
// so the same hook counts instructions for the entry's budget (ws_fuzz_budget).
//
// Built by the WSYNC_FUZZ build (tests/fuzz/run.sh); run with
// `scripts/dev.sh fuzz [SECONDS]`.

#include <limits.h>
#include <lua.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "embed/host_internal.h" // ws_host_lua_state: the hook's state
#include "wsync.h"

#ifndef WSYNC_SOURCE_DIR
#error "WSYNC_SOURCE_DIR (the repository root) must be defined"
#endif

enum {
  EDGE_COUNTERS = 1 << 16, // extra counters: hashed Lua line edges
  BUDGET_STEP = 1000,      // instructions between two budget checks
  SOURCE_CACHE = 256,      // chunk names already classified
};

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
size_t LLVMFuzzerMutate(uint8_t *data, size_t size, size_t max_size);
size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t max_size,
                               unsigned int seed);
const uint8_t *ws_fuzz_input(size_t *size);
unsigned int ws_fuzz_seed(void);
void ws_fuzz_mutation(const uint8_t *bytes, size_t size);
int ws_fuzz_budget(double instructions);
const char *__asan_default_options(void);

// libFuzzer reads this section after every input as extra coverage.
__attribute__((used, section("__libfuzzer_extra_counters")))
static uint8_t edge_counters[EDGE_COUNTERS];

static ws_host *host;
static lua_State *state;
static const uint8_t *input_data;
static size_t input_size;

static struct {
  uint8_t *data; // the input being mutated, rewritten in place
  size_t size;   // the mutation's size; 0: none
  size_t max_size;
  unsigned int seed;
} mutation;

static uintptr_t previous_line;
static struct {
  const char *source;
  uintptr_t hash;
} source_cache[SOURCE_CACHE];

static double budget_left;
static int budget_armed;
static int budget_exhausted;
static char budget_message[4096];

// The repository whose scripts and entry run: WSYNC_SOURCE_DIR, or
// $WSYNC_FUZZ_ROOT for a copy of the target carried to another checkout.
static const char *root;
static char scripts_prefix[PATH_MAX + 16];
static size_t scripts_prefix_length;
static const char entry_suffix[] = "tests/fuzz/entry.lua";

// The hash of a chunk name when it is one of wsync's scripts (a fuzzed
// recipe's own lines are no coverage: every new line would look like one),
// else 0. Chunk names are interned strings, and those of wsync's modules
// live as long as the state: their addresses are cached.
static uintptr_t source_hash(const char *source) {
  size_t slot = ((uintptr_t)source >> 4) % SOURCE_CACHE;
  if (source_cache[slot].source == source)
    return source_cache[slot].hash;
  if (strncmp(source, scripts_prefix, scripts_prefix_length) != 0)
    return 0;
  uintptr_t hash = 1469598103934665603u;
  for (const char *c = source; *c != '\0'; c++)
    hash = (hash ^ (unsigned char)*c) * 1099511628211u;
  source_cache[slot].source = source;
  source_cache[slot].hash = hash | 1;
  return hash | 1;
}

static const char setup_chunk_name[] = "=(fuzz setup)";

// The entry and this file's setup chunk (which arms and disarms the budget).
static int is_harness(const char *source) {
  size_t length = strlen(source), suffix = sizeof entry_suffix - 1;
  return strcmp(source, setup_chunk_name) == 0 ||
         (length >= suffix &&
          strcmp(source + length - suffix, entry_suffix) == 0);
}

// Writes "source:line" of every Lua frame on the stack, innermost first, one
// a line, after the budget's message (the entry reads whose loop it was).
static void describe_stack(lua_State *L) {
  size_t used = strlen(budget_message);
  lua_Debug frame;
  for (int level = 0;
       lua_getstack(L, level, &frame) && used < sizeof budget_message - 1;
       level++) {
    if (!lua_getinfo(L, "Sl", &frame) || frame.currentline < 0)
      continue;
    int written = snprintf(budget_message + used, sizeof budget_message - used,
                           "\n%s:%d", frame.source, frame.currentline);
    if (written < 0)
      break;
    used += (size_t)written;
  }
}

static void hook(lua_State *L, lua_Debug *ar) {
  if (ar->event == LUA_HOOKLINE) {
    if (!lua_getinfo(L, "S", ar))
      return;
    uintptr_t hash = source_hash(ar->source);
    if (hash == 0)
      return;
    uintptr_t line =
        (hash ^ ((uintptr_t)ar->currentline * 0x9e3779b97f4a7c15u)) >> 7;
    edge_counters[(line ^ previous_line) % EDGE_COUNTERS]++;
    previous_line = line >> 1;
    return;
  }
  if (ar->event != LUA_HOOKCOUNT || !budget_armed)
    return;
  if (!budget_exhausted) {
    budget_left -= BUDGET_STEP;
    if (budget_left > 0)
      return;
    budget_exhausted = 1;
    snprintf(budget_message, sizeof budget_message,
             "wsync fuzz: instruction budget exhausted");
    describe_stack(L);
    // From now on every instruction raises, so that a pcall in the loop that
    // ran out cannot catch the error and go on.
    lua_sethook(L, hook, LUA_MASKLINE | LUA_MASKCOUNT, 1);
  }
  // The harness's own frames run on: the entry disarms the budget right
  // after its protected call returns.
  lua_Debug running;
  if (lua_getstack(L, 0, &running) && lua_getinfo(L, "S", &running) &&
      is_harness(running.source))
    return;
  lua_pushstring(L, budget_message);
  lua_error(L);
}

/// Returns ASan's defaults for this target: no leak detection, since
/// LuaJIT's allocator maps memory that LeakSanitizer does not scan, so every
/// handle that only Lua holds would look leaked.
const char *__asan_default_options(void) { return "detect_leaks=0"; }

/// Returns the input being run and stores its size: the entry reads it
/// through the FFI.
const uint8_t *ws_fuzz_input(size_t *size) {
  *size = input_size;
  return input_data;
}

/// Returns the seed of the mutation being made.
unsigned int ws_fuzz_seed(void) { return mutation.seed; }

/// Takes the entry's mutation of the input (ignored when it is empty or
/// longer than libFuzzer allows).
void ws_fuzz_mutation(const uint8_t *bytes, size_t size) {
  if (mutation.data == NULL || size == 0 || size > mutation.max_size)
    return;
  memcpy(mutation.data, bytes, size);
  mutation.size = size;
}

/// Arms the instruction budget of the entry's protected call with
/// `instructions` (> 0), or disarms it (0). Returns 1 when the budget ran out
/// since it was armed, else 0.
int ws_fuzz_budget(double instructions) {
  int exhausted = budget_exhausted;
  if (instructions > 0) {
    budget_left = instructions;
    budget_armed = 1;
    budget_exhausted = 0;
    lua_sethook(state, hook, LUA_MASKLINE | LUA_MASKCOUNT, BUDGET_STEP);
  } else {
    budget_armed = 0;
    budget_exhausted = 0;
    lua_sethook(state, hook, LUA_MASKLINE, 0);
  }
  return exhausted;
}

// Sets the entry up once: the source tree's scripts (line information for the
// coverage hook), the interpreter only (compiled traces call no hooks), the
// budget through the FFI, and a module that runs or mutates the current input.
static const char setup_chunk[] =
    "local root = ...\n"
    "jit.off()\n"
    "jit.flush()\n"
    "package.path = root .. '/?.lua;' .. package.path\n"
    "local ffi = require('ffi')\n"
    "ffi.cdef[[\n"
    "  const uint8_t *ws_fuzz_input(size_t *size);\n"
    "  unsigned int ws_fuzz_seed(void);\n"
    "  void ws_fuzz_mutation(const uint8_t *bytes, size_t size);\n"
    "  int ws_fuzz_budget(double instructions);\n"
    "]]\n"
    "local entry = require('tests.fuzz.entry')\n"
    "entry.set_budget(function(instructions)\n"
    "  return ffi.C.ws_fuzz_budget(instructions) ~= 0\n"
    "end)\n"
    "local size = ffi.new('size_t[1]')\n"
    "local function input()\n"
    "  local data = ffi.C.ws_fuzz_input(size)\n"
    "  return ffi.string(data, size[0])\n"
    "end\n"
    "package.loaded['tests.fuzz.harness'] = {\n"
    "  run = function() entry.run(input()) end,\n"
    "  mutate = function()\n"
    "    local mutated = entry.mutate(input(), ffi.C.ws_fuzz_seed())\n"
    "    if mutated then ffi.C.ws_fuzz_mutation(mutated, #mutated) end\n"
    "  end,\n"
    "}\n";

// Removes the entry's temporary files when the fuzzer exits normally.
static void clean_up(void) {
  if (host != NULL)
    ws_host_run_string(host, "require('tests.fuzz.entry').cleanup()",
                       "=(fuzz cleanup)");
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  root = getenv("WSYNC_FUZZ_ROOT");
  if (root == NULL || root[0] == '\0')
    root = WSYNC_SOURCE_DIR;
  if (strchr(root, '\'') != NULL || strchr(root, '\\') != NULL ||
      strlen(root) > PATH_MAX) {
    fprintf(stderr, "wsync_fuzz: unusable root %s\n", root);
    abort();
  }
  scripts_prefix_length = (size_t)snprintf(
      scripts_prefix, sizeof scripts_prefix, "@%s/scripts/", root);
  char scripts[PATH_MAX + 16];
  snprintf(scripts, sizeof scripts, "%s/scripts", root);
  setenv("WSYNC_SCRIPTS", scripts, 0);
  int status = ws_host_open(&host);
  if (status != 0) {
    fprintf(stderr, "wsync_fuzz: ws_host_open failed (status %d)\n", status);
    abort();
  }
  state = ws_host_lua_state(host);
  // ws_host_run_string passes no arguments: the root goes in as a literal.
  static char code[sizeof setup_chunk + PATH_MAX + 64];
  snprintf(code, sizeof code, "return (function(...)\n%s\nend)('%s')",
           setup_chunk, root);
  if (ws_host_run_string(host, code, setup_chunk_name) != 0) {
    fprintf(stderr, "wsync_fuzz: setup failed: %s\n", ws_host_error(host));
    abort();
  }
  ws_fuzz_budget(0); // the coverage hook, from here on
  atexit(clean_up);
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  input_data = data;
  input_size = size;
  previous_line = 0;
  int status = ws_host_run_string(host, "require('tests.fuzz.harness').run()",
                                  "=(fuzz input)");
  input_data = NULL;
  input_size = 0;
  if (status != 0) {
    fprintf(stderr, "wsync_fuzz: finding: %s\n", ws_host_error(host));
    abort();
  }
  return 0;
}

// A third of the mutations are the entry's, which knows the frames and the
// schemas' words (entry.mutate); the others are libFuzzer's own.
size_t LLVMFuzzerCustomMutator(uint8_t *data, size_t size, size_t max_size,
                               unsigned int seed) {
  if (seed % 3 != 0)
    return LLVMFuzzerMutate(data, size, max_size);
  input_data = data;
  input_size = size;
  mutation.data = data;
  mutation.size = 0;
  mutation.max_size = max_size;
  mutation.seed = seed / 3;
  int status = ws_host_run_string(
      host, "require('tests.fuzz.harness').mutate()", "=(fuzz mutation)");
  size_t mutated = mutation.size;
  mutation.data = NULL;
  input_data = NULL;
  input_size = 0;
  if (status != 0) {
    fprintf(stderr, "wsync_fuzz: the entry's mutator failed: %s\n",
            ws_host_error(host));
    abort();
  }
  return mutated > 0 ? mutated : LLVMFuzzerMutate(data, size, max_size);
}
