// wsync embedding API: open a host, run Lua chunks, files and recipes, close;
// and the agent API, wsync's part inside a trainer rank written in C.
//
// A host owns one LuaJIT state with the wsync modules and one libuv loop. It is
// not thread-safe: use a host from the thread that opened it. Its only
// preprocessor lines are the guard, one include and extern "C", so LuaJIT's
// ffi.cdef reads it once those lines are dropped (the build does that with
// WS_FFI defined).
#pragma once

#ifndef WS_FFI
#include <stddef.h>
#include <stdint.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ws_host ws_host;

/// Opens a host: a Lua state with the wsync modules and a libuv loop. Stores it
/// in `*out` and returns 0, or stores NULL and returns a negative status;
/// ws_last_error() then says why. The process's signal dispositions stay as
/// they are: every ws_host_* and ws_agent_* call blocks SIGPIPE in its thread
/// while wsync's code runs (a write to a dead peer then fails with EPIPE
/// instead of killing the process), consumes the SIGPIPE those writes raised,
/// and restores the thread's mask before it returns and around step
/// callbacks. Threads that wsync's code starts inherit the blocked SIGPIPE.
int ws_host_open(ws_host **out);

/// Runs a Lua chunk, then the loop until no work is left. Returns 0, or a
/// negative status with the failure in ws_host_error(). A failure of wsync's
/// own reads as `wsync run` prints it, then its code in parentheses: "MESSAGE
/// (CODE)", or "MESSAGE (CODE, cause C)"; its status is WS_EINVAL when what the
/// caller gave is refused (codes RECIPE_INVALID, SCRIPT_INVALID, USAGE,
/// INVALID_ARGUMENT) and
/// WS_EFAILED otherwise, with no traceback unless $WSYNC_TRACEBACK is 1. A Lua
/// error (a bug in a script) is WS_ELUA, code LUA_ERROR, with its traceback.
/// Every ws_host_* call that runs wsync's scripts reports failures so.
int ws_host_run_string(ws_host *host, const char *code, const char *chunk_name);

/// Runs a Lua chunk without running the loop (the chunk must not wait on it)
/// and copies what it returns, as a string ("" for nil), into `result`
/// (`result_size` bytes). WS_EINVAL when the result does not fit; other
/// failures as ws_host_run_string.
int ws_host_eval(ws_host *host, const char *code, char *result,
                 size_t result_size);

/// Calls one of wsync's functions for embedding programs by `name` with the
/// JSON object `args_json`, without running the loop beyond what the call
/// needs, and writes its answer as JSON into `result` (`result_size` bytes):
/// {"ok": true, "result": ...}, or {"ok": false, "error": {"code", "message",
/// "fields"}} when wsync refuses or fails (fields: phase, rank, field, fatal,
/// cause... as the error has them). Returns 0 with either answer; WS_EINVAL
/// when the answer does not fit; WS_ELUA for a bug, as ws_host_run_string.
/// The calls (scripts/wsync/cli/embedded.lua, M.CALLS): "recipe" {recipe,
/// overrides}, "trainer_tensors" {recipe, overrides}, "reports" {}, "rollout"
/// {cmd, payload}, "loader_plan" {family, config, world, rank},
/// "worker_command" {cmd, payload}, "device" {backend, index}.
int ws_host_call(ws_host *host, const char *name, const char *args_json,
                 char *result, size_t result_size);

/// Runs a Lua file with `argc` arguments in `arg`, then the loop.
int ws_host_run_file(ws_host *host, const char *path, int argc,
                     const char *const *argv);

/// Runs a recipe file (`wsync run`), with `key=value` overrides.
int ws_host_run_recipe(ws_host *host, const char *path, int argc,
                       const char *const *argv);

/// Starts a model recipe's session in this host, for a trainer whose ranks
/// are agents of this same host (a single-process trainer): the recipe's
/// trainer kind must be "external". Runs the loop until the control endpoint
/// listens and writes its path into `endpoint` (`endpoint_size` bytes, 4096
/// is enough). The session then advances while the agents' ws_agent_* calls
/// run the loop. No signal handler is installed. One session at a time.
int ws_host_start_recipe(ws_host *host, const char *path, int argc,
                         const char *const *argv, char *endpoint,
                         size_t endpoint_size);

/// Runs the loop until the session of ws_host_start_recipe ended (close the
/// agents first: the session waits for its ranks to leave). Returns 0 when it
/// ended well, or a negative status with its failure in ws_host_error().
/// ws_host_close on a session not finished stops it fail-stop (the runtime
/// is killed, nothing more is published).
int ws_host_finish_recipe(ws_host *host);

/// Runs the command line (`wsync ARGS...`) and returns the process exit code.
int ws_host_main(ws_host *host, int argc, const char *const *argv);

/// Returns the last error message of this host, or an empty string.
const char *ws_host_error(const ws_host *host);

/// Returns why the last ws_host_open or ws_agent_open called on this thread
/// failed, or an empty string when it succeeded. The text is per thread and
/// stays until the next of those calls on the thread; it is the only way to
/// learn why ws_host_open failed, as there is no host to ask.
const char *ws_last_error(void);

/// Returns the wsync version string.
const char *ws_version(void);

/// Stops new work, closes every handle and the loop, closes the Lua state and
/// frees the host. NULL is accepted. Agents still open lose their host: every
/// later ws_agent_* call on them fails with WS_ESTATE ("the agent's host was
/// closed") and ws_agent_close only frees them (close them first to leave the
/// publication cleanly). Refused
/// (the host stays open, ws_host_error says why) from inside a step callback,
/// as are ws_host_run_* (WS_ESTATE).
void ws_host_close(ws_host *host);

// ---------------------------------------------------------------------------
// Agent API: one trainer rank joins the publications of a wsync host (`wsync
// run` on a recipe with `trainer = {kind = "external"}`) over its control
// endpoint. The agent lives in the Lua state of `host`, the rank's own host.
// Calls block: each runs the host's loop until it is done, serving the host's
// commands (buffers, fills, step callbacks) meanwhile. Status: 0, or negative
// (ws_status of status_defs.h, installed with this header):
// WS_EINVAL (bad argument), WS_ESTATE (out of order, called from inside a
// step callback, or the host was closed), WS_EFAILED (the operation failed),
// WS_ELUA (a bug); the text is in ws_agent_error(), or, when ws_agent_open
// fails, in ws_last_error() (and in ws_host_error() of a non-NULL host).
// A host that died fails the next call (WS_EFAILED) instead of killing the
// trainer, whatever its SIGPIPE disposition (see ws_host_open).

typedef struct ws_agent ws_agent;

/// What a publication returns to every rank.
typedef struct ws_publish_result {
  int64_t model_version;     // the version the rollout runtime committed
  char publication_id[33];   // 32 hex digits
  char manifest[65];         // SHA-256 of the structural records, 64 hex digits
  int receipts;              // TP workers that returned a valid receipt
} ws_publish_result;

/// Connects trainer rank `rank` of `world` to the control endpoint: the unix
/// socket path the host printed or its recipe fixed (control.endpoint), or
/// `tcp://ADDRESS:PORT?token=TOKEN` (without `?token=`: the token from
/// $WSYNC_TOKEN or the file $WSYNC_TOKEN_FILE names). A NULL `endpoint` means
/// $WSYNC_ENDPOINT, as a launcher sets it for every rank (when it is not set,
/// the call fails naming it). `backend` is "host" (NULL) or "cuda";
/// `device_index` < 0 means the rank's own index. Stores the agent in `*out`.
int ws_agent_open(ws_host *host, const char *endpoint, int rank, int world,
                  const char *backend, int device_index, ws_agent **out);

/// Registers one tensor of global shape `shape[0..dims)`: `data` holds this
/// rank's `row_count` rows of dim 0 from `first_row`, row-major, in
/// `data_bytes` bytes. The memory must stay valid and hold the values to
/// publish whenever ws_agent_publish runs, until ws_agent_close.
int ws_agent_register_tensor(ws_agent *agent, const char *name,
                             const char *dtype, const int64_t *shape, int dims,
                             void *data, uint64_t data_bytes, int64_t first_row,
                             int64_t row_count);

/// Tells the agent that tensor `name`'s rows now live at `data` (`data_bytes`
/// bytes), after an offload and a reload moved its storage; its dtype, shape
/// and rows stay as registered. The agent reads every tensor's pointer at the
/// start of each publication (after the schedule's steps before "publish"),
/// so this may be called between publications and from inside a step
/// callback, the one agent call allowed there. The direct path (one rank on
/// cuda, `buffers.direct`) refuses storage that moved after its session began.
int ws_agent_set_tensor_data(ws_agent *agent, const char *name, void *data,
                             uint64_t data_bytes);

/// Registers a step callback that the host's memory schedule calls by name
/// (e.g. "offload_optimizer"). A non-zero return fails that schedule step; the
/// error names the callback and the rank. A callback must not call wsync.
int ws_agent_register_callback(ws_agent *agent, const char *name,
                               int (*callback)(void *user_data),
                               void *user_data);

/// Registers a step callback, as ws_agent_register_callback, that confirms it
/// ran to its end: before each call the agent sets `*done` to 0, and the step
/// succeeds only when the callback returned 0 and set `*done` to 1. One that
/// leaves `*done` at 0 fails its step as interrupted before it completed,
/// whatever it returned (for callbacks that can be unwound before they run:
/// a Python callback that a signal interrupts at its entry returns an
/// undefined value); one that set it and returned non-zero fails its step as
/// a failed callback.
int ws_agent_register_confirmed_callback(ws_agent *agent, const char *name,
                                         int (*callback)(void *user_data,
                                                         int *done),
                                         void *user_data);

/// Says, from inside a step callback, how many bytes the callback moved (an
/// offload's or an onload's): the host's run report shows it as that step's
/// bytes, added up over the ranks. Allowed inside a step callback, where
/// ws_agent_set_tensor_data is too; called anywhere else it is forgotten at
/// the next callback. WS_EINVAL above 2^53 bytes.
int ws_agent_report_moved(ws_agent *agent, uint64_t bytes);

/// Sets a check that ws_agent_ready and ws_agent_publish call about every 100
/// ms while they wait on the loop, with the protocol of a confirmed callback:
/// it completes when it returns 0 and sets `*done` to 1. A check that does not
/// complete (the trainer was interrupted: Python's check is unwound by a
/// KeyboardInterrupt at its entry) abandons the call fail-stop: the call fails
/// with WS_EFAILED (INTERRUPTED), the rank leaves its host, a session that this
/// same host runs on the agent's endpoint (ws_host_start_recipe) is stopped as
/// ws_host_close stops it, and every later call but ws_agent_close fails. NULL
/// removes the check. Like a step callback, it must not call wsync.
int ws_agent_set_interrupt_check(ws_agent *agent,
                                 int (*check)(void *user_data, int *done),
                                 void *user_data);

/// Sends the registration; returns when every rank registered and the host
/// is ready.
int ws_agent_ready(ws_agent *agent);

/// Joins the collective publication of trainer step `step` (every rank calls
/// it with the same step; negative lets the host number it). Fills `*result`
/// (NULL accepted). On failure the error text is the same on every rank.
int ws_agent_publish(ws_agent *agent, int64_t step, ws_publish_result *result);

/// ws_agent_publish that also asks the schedule's "generate" step (after
/// "publish") to generate for this rank with the weights just published:
/// `generate_json` is a JSON object {"prompts": [[token id, ...], ...],
/// "sampling": {...}} (sampling as the runtime's generate takes it, the same
/// on every rank that asks; NULL: ask nothing). Its outputs are then
/// ws_agent_generation's. A recipe whose schedule does not generate after
/// "publish" refuses the call (INVALID_ARGUMENT).
int ws_agent_publish_generate(ws_agent *agent, int64_t step,
                              const char *generate_json,
                              ws_publish_result *result);

/// Returns what the last successful ws_agent_publish_generate generated for
/// this rank, as JSON {"model_version": N, "outputs": [...]} (the runtime's
/// outputs of this rank's prompts, in order, each stamped with the version
/// it was generated with), or an empty string when it asked nothing. Valid
/// until the next publish or ws_agent_close.
const char *ws_agent_generation(const ws_agent *agent);

/// Returns the report of this agent's last successful ws_agent_publish, as
/// JSON (its round: the schedule's steps and the waits for the ranks, each
/// with its seconds; the publication's phases in `timings`, its bytes, the
/// receipts; sorted keys, wsync.publish.report), or an empty string before
/// the first. Valid until the next ws_agent_publish or ws_agent_close.
const char *ws_agent_report(const ws_agent *agent);

/// Returns the last error text of this agent, or an empty string.
const char *ws_agent_error(const ws_agent *agent);

/// Closes the connection, unmaps every buffer the agent mapped and frees the
/// agent. NULL is accepted; ignored when called from inside a step callback.
void ws_agent_close(ws_agent *agent);

#ifdef __cplusplus
}
#endif
