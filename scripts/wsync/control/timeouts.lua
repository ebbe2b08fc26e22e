--- Every timeout of wsync, in seconds, defined once: the default of each
--- key a recipe's `timeouts` may set, and what it bounds. The session, the
--- runtime client and the recipe schema all read this table; the runtime's
--- main process gives its TP workers a little less of each
--- (wsync.control.client.inner_timeouts).
local M = {}

--- What each key bounds, and its default.
M.KEYS = {
  -- The session's waits.
  { key = "registration", default = 60, bounds = "every trainer rank registering" },
  { key = "publish", default = 300, bounds = "every rank calling publish once the first did" },
  { key = "train_step", default = 3600,
    bounds = "the first call of publish after the last answer (the training step)" },
  -- Commands to a trainer rank.
  { key = "init", default = 120, bounds = "a rank creating, exporting or attaching its packed buffers" },
  { key = "start", default = 60, bounds = "a rank beginning a publication or reporting its free memory" },
  { key = "fill", default = 120, bounds = "a rank filling a chunk" },
  { key = "verify", default = 60, bounds = "a rank's consumed manifest" },
  { key = "callback", default = 120, bounds = "a rank's step callback (offload, onload)" },
  { key = "values_sums", default = 600, bounds = "a rank summing its values for the values check (verify)" },
  -- Commands to the rollout runtime (its TP workers get a little less).
  { key = "startup", default = 30, bounds = "the runtime's startup handshake, its TP workers' included" },
  { key = "info", default = 10, bounds = "the runtime's info" },
  { key = "sleep", default = 60, bounds = "the runtime's sleep" },
  { key = "wake", default = 60, bounds = "the runtime's wake" },
  { key = "generate", default = 600, bounds = "the runtime's generate" },
  { key = "pause", default = 120, bounds = "the runtime pausing generation (a wait-mode pause waits for the requests "
    .. "in flight)" },
  { key = "shutdown", default = 10,
    bounds = "the runtime's shutdown, and the ranks leaving (or hearing a failure) at the session's end" },
  { key = "default", default = 60, bounds = "any other runtime command (init_weights, start_update, load_chunk, "
    .. "finish_update, release, resident_checksums, ...), unless its own key is given" },
  { key = "init_weights", bounds = "the runtime importing the buffers and sizing its resident storage" },
  { key = "start_update", bounds = "the runtime entering an update" },
  { key = "load_chunk", bounds = "the runtime loading a chunk" },
  { key = "finish_update", bounds = "the runtime's receipts and commit" },
  { key = "release", bounds = "the runtime's release" },
  { key = "resident_checksums", bounds = "the runtime's checksums of its resident tensors (verify)" },
  { key = "resident_check", bounds = "the runtime's check of its resident tensors on the device (verify)" },
  { key = "resident_values", bounds = "the runtime's values sums of its resident tensors (verify = \"values\")" },
}

--- The defaults, by key (keys without one fall back to `default` when a
--- runtime command is timed).
M.DEFAULTS = {}
for _, entry in ipairs(M.KEYS) do
  M.DEFAULTS[entry.key] = entry.default
end

--- The defaults with `overrides` (a recipe's `timeouts`) laid over them.
---@param overrides table<string, number>?
---@return table<string, number>
function M.with(overrides)
  return require("wsync.util").merged(M.DEFAULTS, overrides)
end

--- The timeout of runtime command `cmd` in `timeouts` (M.with's result).
---@param timeouts table<string, number>
---@param cmd string
---@return number
function M.of_command(timeouts, cmd)
  return timeouts[cmd] or timeouts.default
end

return M
