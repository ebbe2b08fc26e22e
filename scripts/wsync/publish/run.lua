--- A model recipe's run to the end (`wsync run RECIPE`, an embedding host's
--- run; wsync.publish.session's M.run is this): Ctrl-C and SIGTERM stop it
--- at once (fail-stop: the session is aborted, leaving nothing behind, and
--- the process exits 128 + signal), the session opens, its rounds run until
--- the recipe's steps are done or it fails, the ranks are let go and
--- everything is closed; then the closing report and the verdict, once. A
--- synthetic trainer process that exited with a code other than 0 fails a
--- run that nothing else failed.
local uv = require("luv")
local console = require("wsync.publish.console")
local errors = require("wsync.errors")

local M = {}

local say = console.say

-- The closing report (wsync.publish.console), line by line.
local function closing_report(session)
  for _, line in ipairs(console.closing(session, session.report:text_lines(), session.reports,
    session.trainers:ends())) do
    say("%s", line)
  end
end

-- Ctrl-C or SIGTERM (unless `enabled` is false): `on_signal(NAME)`, then
-- exit 128 + signal. Returns the function that stops watching them.
local function watch_signals(enabled, on_signal)
  local signals = {}
  for name, number in pairs(enabled == false and {} or { sigint = 2, sigterm = 15 }) do
    local handle = uv.new_signal()
    handle:start(name, function()
      on_signal(name:upper())
      os.exit(128 + number)
    end)
    handle:unref() -- the run ends when its work does, not when signals stop
    signals[#signals + 1] = handle
  end
  return function()
    for _, handle in ipairs(signals) do
      if not handle:is_closing() then
        handle:close()
      end
    end
  end
end

--- Runs `recipe` to the end with `sessions` (wsync.publish.session: its
--- open, close and abort; a test's stand-in) and `options` (as
--- wsync.publish.session.run's). Returns the session's reports; raises the
--- first failure after everything was closed, its verdict printed (and the
--- error marked reported: wsync.errors.set_reported).
---@param sessions table
---@param recipe table
---@param options table?
---@return table[]
function M.run(sessions, recipe, options)
  options = options or {}
  -- (Not in an embedding host's session: the process's signals are its own.)
  local opened = nil
  local stop_signals = watch_signals(options.signals, function(signal_name)
    if opened then
      sessions.abort(opened, signal_name)
    end
  end)
  local open_ok, session = pcall(sessions.open, recipe, { on_open = function(created)
    opened = created
    if options.report_file then
      created.report:write_to(options.report_file)
    end
    if options.on_open then
      options.on_open(created)
    end
  end, on_listen = options.on_listen, publication = options.publication })
  if not open_ok then
    -- (open closed everything it had started.)
    stop_signals()
    if opened then
      closing_report(opened)
      opened.report:finish(session)
    end
    say("verdict: FAILED: %s", tostring(session))
    errors.set_reported(session) -- (the verdict says it: once)
    error(session, 0)
  end
  local ok, err = pcall(function()
    while session:wait_publish() do
      session:round()
    end
    -- Every publication the recipe asks for is done, or the session failed.
    session:finish()
  end)
  if not ok then
    session:fail(errors.is(err) and err or errors.new("LUA_ERROR", tostring(err)))
  end
  sessions.close(session)
  stop_signals()
  if not session.failure then
    local trainer_failure = session.trainers:failure(session.timeouts.shutdown)
    if trainer_failure then
      session:fail(trainer_failure)
    end
  end
  closing_report(session)
  session.report:finish(session.failure)
  if session.failure then
    say("verdict: FAILED: %s", tostring(session.failure))
    errors.set_reported(session.failure) -- (the verdict says it: once)
    error(session.failure, 0)
  end
  say("verdict: OK: %d model versions published%s", session.report.published,
    session.recipe.verify and (", every resident TP slice verified" .. (session.recipe.verify == "values"
      and " against the trainer's values" or "")) or "")
  return session.reports
end

return M
