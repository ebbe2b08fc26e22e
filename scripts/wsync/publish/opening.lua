--- A session's opening, in order, each step timed into the run report's
--- opening (wsync.publish.session's open runs it, and stops the session
--- when it raises):
---
--- 1. listen: the names that dead processes left are removed, the control
---    endpoint opens (wsync.publish.registry), the synthetic trainer
---    processes start (wsync.publish.trainers), or the host says it waits for
---    external ones;
--- 2. registration: every rank registers (a trainer process that exited, a
---    lost rank or a failure ends the wait early); the ranks' rows are
---    checked together, and the schedule again, against the callbacks that
---    every rank registered, so that a step no rank can run is refused now,
---    not after a publication committed;
--- 3. runtime start: the rollout runtime on the ranks' devices in rank order
---    (wsync.publish.rollout), the bootstrap's schedule steps, and the
---    requests that stream through the session (rollout.stream).
local console = require("wsync.publish.console")
local prepare_module = require("wsync.recipe.prepare")
local report_module = require("wsync.publish.report")
local trainers_module = require("wsync.publish.trainers")
local transport_module = require("wsync.transport")

local M = {}

local say = console.say

--- Step 1: the endpoint, and the synthetic trainers (external ones are
--- waited for). Sets `session.endpoint`; calls `session.on_listen(path)`
--- when set.
---@param session wsync.Session
function M.listen(session)
  -- (Segments of this user's processes that died with SIGKILL hold memory
  -- until someone removes them: a host does, as it does their directories.)
  for _, transport in ipairs(transport_module.with("named_leftovers")) do
    transport.remove_dead_segments(function(line)
      say("%s", line)
    end)
  end
  session.endpoint = session.registry:listen(session.recipe)
  local world = session.topology.world
  if session.recipe.trainer.kind == "synthetic" then
    session.trainers:spawn(world, trainers_module.synthetic(session.recipe, session.endpoint.path, world))
  else
    say("waiting for %d external trainer ranks on %s", world, session.endpoint.path)
  end
  if session.on_listen then
    session.on_listen(session.endpoint.path)
  end
end

--- Step 2: every rank registers, within timeouts.registration; then the
--- ranks are checked together and `session.ranks` drives them; then the
--- schedule is checked against the callbacks every rank has.
---@param session wsync.Session
function M.await_registration(session)
  session.phase = "registration"
  session.registry:await_registration(session.timeouts.registration, function()
    return session.trainers:any_exited()
  end)
  session.ranks = session.registry:ranks(session.transport.GATHER)
  -- (Each rank's tensors were checked as it registered; now the ranks' rows
  -- together.)
  session.ranks:check_registration(session.plan)
  prepare_module.check_schedule(session.recipe, session.plan, session.topology, session.registry:common_callbacks())
end

--- Step 3: the runtime on the ranks' devices (`session:spawn_rollout()`),
--- the bootstrap's steps (`session:run_step(step)`), then the streaming
--- requests submitted. Sets `session.rollout`.
---@param session wsync.Session
function M.start_rollout(session)
  local recipe = session.recipe
  say("%d trainer ranks registered; starting the %s runtime (%s) on their devices in rank order",
    session.topology.world, recipe.runtime.kind, console.runtime_shape(session.topology))
  session.phase = "runtime start"
  session.rollout = report_module.timed(session.report.opening, "runtime start", "start", function()
    return session:spawn_rollout()
  end)
  for _, step in ipairs(session.bootstrap) do
    session:run_step(step)
  end
  if #session.bootstrap > 0 then
    say("bootstrap done: rollout weights %s", session.rollout:request("info").state.weights)
  end
  local stream = recipe.rollout
  if stream then
    local requests = {}
    for i = 1, stream.stream do
      requests[i] = { prompt = { i }, max_tokens = stream.max_tokens }
    end
    session.rollout:request("submit", { requests = requests })
    say("%d requests stream in the rollout runtime (rollout.stream); each round says what they produced", stream.stream)
  end
end

--- The three steps in order, each timed into the report's opening (the
--- runtime start times itself, as "runtime start", and the bootstrap's
--- steps are their own).
---@param session wsync.Session
function M.run(session)
  local opening = session.report.opening
  report_module.timed(opening, "listen", "open", function()
    M.listen(session)
  end)
  report_module.timed(opening, "registration", "wait", function()
    M.await_registration(session)
  end)
  M.start_rollout(session)
end

return M
