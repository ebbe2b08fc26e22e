-- wsync.publish.opening, on a fake session (registry, trainers, runtime):
-- the order of its steps and what each sets, says and times; the schedule
-- checked against the callbacks every rank registered; a failed step stops
-- the opening there.
local errors = require("wsync.errors")
local opening = require("wsync.publish.opening")
local recipe_module = require("wsync.recipe")
local report_module = require("wsync.publish.report")
local transport_module = require("wsync.transport")
local captured = require("tests.helpers.stdout").captured
local error_of = require("tests.helpers.errors").error_of

local demo = recipe_module.load("recipes/demo.lua")
local plan, topology = require("wsync.recipe.prepare").prepare(demo, { plan_only = true })

-- What the fake session's parts did, in order.
local did

-- A session of the demo recipe (changed by `recipe_fields`) whose registry,
-- trainers and runtime are fakes; `fail` names a step of theirs that raises.
local function session_of(recipe_fields, fail)
  local recipe = setmetatable(recipe_fields or {}, { __index = demo })
  local session = {
    recipe = recipe, plan = plan, topology = topology, timeouts = { registration = 7 },
    transport = { GATHER = "shared" }, report = report_module.new({ recipe = recipe }), bootstrap = { "a", "b" },
    callbacks = { offload_optimizer = true, onload_optimizer = true, offload_actor = true, onload_actor = true },
  }
  local function done(what)
    did[#did + 1] = what
    if what == fail then
      errors.raise("STARTUP", what .. " failed")
    end
  end
  session.registry = {
    listen = function(_, listened)
      done("listen " .. listened.name)
      return { path = "/tmp/control.sock" }
    end,
    await_registration = function(_, seconds, exited)
      done(string.format("await_registration %g %s", seconds, tostring(exited())))
    end,
    ranks = function(_, gather)
      done("ranks " .. gather)
      return { check_registration = function(_, checked)
        done("check_registration " .. (checked == plan and "plan" or "?"))
      end }
    end,
    common_callbacks = function()
      return session.callbacks
    end,
  }
  session.trainers = {
    spawn = function(_, world, launch)
      done(string.format("spawn %d %s", world, type(launch)))
    end,
    any_exited = function()
      return true
    end,
  }
  session.rollout_asked = {}
  function session.spawn_rollout()
    done("spawn_rollout")
    return { request = function(_, cmd, payload)
      session.rollout_asked[#session.rollout_asked + 1] = { cmd = cmd, payload = payload }
      return { state = { weights = "in host memory" } }
    end }
  end
  function session.run_step(_, step)
    done("run_step " .. step)
  end
  function session.on_listen(path)
    done("on_listen " .. path)
  end
  return session
end

describe("wsync.publish.opening", function()
  local saved_with
  before_each(function()
    did = {}
    -- (No transport's dead segments here: that is the transport's spec.)
    saved_with = transport_module.with
    transport_module.with = function()
      return {}
    end
  end)
  after_each(function()
    transport_module.with = saved_with
  end)

  it("runs its steps in order, each timed into the report's opening", function()
    local session = session_of()
    local said = captured(opening.run, session)
    assert.are.same({
      "listen demo", "spawn 2 function", "on_listen /tmp/control.sock",
      "await_registration 7 true", "ranks shared", "check_registration plan",
      "spawn_rollout", "run_step a", "run_step b",
    }, did)
    assert.are.equal("wsync: 2 trainer ranks registered; starting the reference runtime (TP2) on their devices in "
      .. "rank order\nwsync: bootstrap done: rollout weights in host memory\n", said)
    assert.are.equal("/tmp/control.sock", session.endpoint.path)
    assert.is_table(session.ranks)
    assert.is_table(session.rollout)
    assert.are.equal("runtime start", session.phase)
    local names = {}
    for _, step in ipairs(session.report.opening.steps) do
      names[#names + 1] = step.name .. " " .. step.kind .. " " .. step.outcome
    end
    assert.are.same({ "listen open ok", "registration wait ok", "runtime start start ok" }, names)
  end)

  it("waits for external trainer ranks instead of starting them", function()
    local session = session_of({ trainer = { kind = "external", ranks = 2, steps = 3 } })
    local said = captured(opening.listen, session)
    assert.are.same({ "listen demo", "on_listen /tmp/control.sock" }, did)
    assert.are.equal("wsync: waiting for 2 external trainer ranks on /tmp/control.sock\n", said)
  end)

  it("refuses a schedule step that not every rank has the callback for, after registration", function()
    local session = session_of()
    session.callbacks = { offload_optimizer = true, onload_optimizer = true, offload_actor = true }
    local err = error_of(opening.await_registration, session)
    assert.are.equal("registration", session.phase)
    assert.are.equal("check_registration plan", did[#did])
    assert.matches("onload_actor", err.message, 1, true)
    assert.matches("not a callback that every trainer rank has (they have: offload_actor, offload_optimizer, "
      .. "onload_optimizer)", err.message, 1, true)
  end)

  it("starts the requests that stream through the session", function()
    local session = session_of({ rollout = { stream = 2, max_tokens = 4 } })
    session.bootstrap = {}
    local said = captured(opening.start_rollout, session)
    assert.are.same({ { cmd = "submit", payload = { requests = { { prompt = { 1 }, max_tokens = 4 },
      { prompt = { 2 }, max_tokens = 4 } } } } }, session.rollout_asked)
    assert.matches("\nwsync: 2 requests stream in the rollout runtime %(rollout.stream%); each round says what they "
      .. "produced\n$", said)
  end)

  it("stops at the step that failed, timed as failed", function()
    local session = session_of(nil, "ranks shared")
    local err = error_of(captured, opening.run, session)
    assert.are.equal("ranks shared failed", err.message)
    assert.are.equal("ranks shared", did[#did])
    local last = session.report.opening.steps[#session.report.opening.steps]
    assert.are.equal("registration", last.name)
    assert.are.equal("failed", last.outcome)
    assert.is_nil(session.rollout)
  end)
end)
