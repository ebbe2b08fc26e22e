-- wsync.publish.registry, with fake peers and a fake session: registration
-- (refusals, a mismatch with the plan, the wait for every rank), a lost
-- rank's error, the endpoint's callbacks, the publish collective (every
-- rank's call answered once; the waits' timeouts), and the end (the failure
-- told, the wait for the ranks to leave).
local async = require("tests.helpers.async")
local loop = require("wsync.loop")
local plan_module = require("wsync.plan")
local registry_module = require("wsync.publish.registry")
local captured = require("tests.helpers.stdout").captured
local error_of = require("tests.helpers.errors").error_of

local plan = plan_module.build({ family = "qwen3_moe", config = "tiny" }, { bytes = 1024 * 1024 })

-- The plan's layout as rank `rank` of `world` registers it (dim-0 rows split
-- evenly, the last rank taking the rest).
local function tensors_of(rank, world)
  local tensors = {}
  for index, tensor in ipairs(plan.layout) do
    local rows = math.floor(tensor.shape[1] / world)
    local first = rank * rows
    if rank == world - 1 then
      rows = tensor.shape[1] - first
    end
    tensors[index] = { name = tensor.name, dtype = tensor.dtype, shape = { unpack(tensor.shape) },
      rows = { first, rows } }
  end
  return tensors
end

-- What rank `rank` of `world` sends to register.
local function payload(rank, world, fields)
  local registration = { rank = rank, world = world, pid = 100 + rank, device = { uuid = "GPU-" .. rank, index = rank },
    tensors = tensors_of(rank, world), callbacks = { "offload_actor", "onload_actor" } }
  for key, value in pairs(fields or {}) do
    registration[key] = value
  end
  return registration
end

-- A connection: what it was asked, whether and why it was closed.
local function peer(name)
  local fake = { name = name, closed = false, inflight = {}, requests = {} }
  function fake.watch(self, on_slow)
    self.on_slow = on_slow
  end
  function fake.close(self, reason)
    self.closed = reason
  end
  function fake.request(self, cmd, request_payload, timeout)
    self.requests[#self.requests + 1] = { cmd = cmd, payload = request_payload, timeout = timeout }
  end
  return fake
end

-- The session a registry serves: `steps` publications (rounds counts them),
-- the failures it was told, and a state.
local function session_of(steps)
  local session = { condition = loop.condition(), phase = "registration", rounds = 0, versions = { committed = 4 },
    trainer_steps = steps or 3, failures = {} }
  function session.steps_done(self)
    return self.rounds >= self.trainer_steps
  end
  function session.fail(self, err)
    self.failures[#self.failures + 1] = err
    self.stopped = self.stopped or err
    self.condition:notify()
  end
  function session.state()
    return "the state"
  end
  function session.where(self)
    return "phase " .. self.phase
  end
  return session
end

local function registry_for(world, session, fields)
  local options = { world = world, plan = plan, steps = session.trainer_steps }
  for key, value in pairs(fields or {}) do
    options[key] = value
  end
  return registry_module.new(session, options)
end

-- Registers ranks 0 .. world - 1 of a session already ready; returns their peers.
local function register_all(registry, session, world)
  session.ready = true
  local peers = {}
  for rank = 0, world - 1 do
    peers[rank] = peer("peer " .. rank)
    registry:handlers(peers[rank]).register(payload(rank, world))
  end
  return peers
end

describe("wsync.publish.registry", function()
  local saved_after
  before_each(function()
    saved_after = loop.PROGRESS_AFTER
    loop.PROGRESS_AFTER = 0
  end)
  after_each(function()
    loop.PROGRESS_AFTER = saved_after
  end)

  describe("registration", function()
    it("takes each rank, says it (external ranks), and answers them all once the session is ready", function()
      local session = session_of()
      local registry = registry_for(2, session, { announce = true })
      local answers = {}
      local said = captured(async.run_async, function()
        local waits = {}
        for rank = 0, 1 do
          waits[rank] = async.start(registry:handlers(peer("peer " .. rank)).register, payload(rank, 2))
        end
        registry:await_registration(5, function()
          return false
        end)
        assert.are.equal(2, registry:count())
        session.ready = true
        session.condition:notify()
        for rank = 0, 1 do
          local ok, answer = waits[rank]()
          assert(ok, answer)
          answers[rank] = answer
        end
      end)
      assert.are.equal("wsync: trainer rank 0 registered (pid 100, device GPU-0): 1 of 2\n"
        .. "wsync: trainer rank 1 registered (pid 101, device GPU-1): 2 of 2\n", said)
      assert.are.same({ plan = plan_module.summary(plan), model_version = 4 }, answers[1])
      assert.are.equal(2, #registry:ranks().agents)
      assert.are.same({ offload_actor = true, onload_actor = true }, registry:common_callbacks())
    end)

    it("refuses a rank outside the world, another world, and a rank registered twice", function()
      local session = session_of()
      local registry = registry_for(2, session)
      local register = registry:handlers(peer("late")).register
      local err = error_of(register, payload(2, 2))
      assert.are.equal("REGISTER", err.code)
      assert.are.equal("rank 2 outside the recipe's 2 trainer ranks", err.message)
      err = error_of(register, payload(1, 3))
      assert.are.equal("rank 1 says world 3; the recipe says 2", err.message)
      assert.are.equal(1, err.rank)
      register_all(registry, session, 2)
      registry:lose(1, "connection closed")
      err = error_of(register, payload(1, 2, { pid = 200 }))
      assert.are.equal("rank 1 registered twice (pid 101, then pid 200); its first connection was lost (connection "
        .. "closed) and a session does not take a rank back", err.message)
    end)

    it("fails with the lowest rank's registration that does not fit the plan, once every rank registered", function()
      local session = session_of()
      local registry = registry_for(3, session)
      local err
      async.run_async(function()
        for rank = 2, 0, -1 do
          local registration = payload(rank, 3)
          if rank > 0 then
            table.remove(registration.tensors, 1)
          end
          async.start(registry:handlers(peer("peer " .. rank)).register, registration)
        end
        err = error_of(registry.await_registration, registry, 5, function()
          return false
        end)
        session:fail(err) -- (the session's opening does: the ranks hear it)
      end)
      assert.are.equal("REGISTER", err.code)
      assert.are.equal(1, err.rank)
      assert.matches("trainer rank 1 did not register " .. plan.layout[1].name, err.message, 1, true)
    end)

    it("gives up on ranks that do not register in time, or once a trainer process exited", function()
      local messages = {}
      async.run_async(function()
        for _, exited in ipairs({ false, true }) do
          local session = session_of()
          local registry = registry_for(2, session)
          async.start(registry:handlers(peer("peer 1")).register, payload(1, 2))
          local err = error_of(registry.await_registration, registry, 0.05, function()
            return exited
          end)
          assert.are.equal("STARTUP", err.code)
          messages[#messages + 1] = err.message
          session:fail(err)
        end
      end)
      assert.are.same({ "1 of 2 trainer ranks registered within 0.05 s (timeouts.registration)",
        "1 of 2 trainer ranks registered within 0.05 s (timeouts.registration) (a trainer process exited)" },
        messages)
    end)

    it("says which ranks it still waits for", function()
      loop.PROGRESS_AFTER = 0.02
      local said = captured(async.run_async, function()
        local session = session_of()
        local registry = registry_for(4, session)
        async.start(registry:handlers(peer("peer 1")).register, payload(1, 4))
        error_of(registry.await_registration, registry, 0.05, function()
          return false
        end)
        session:fail("done")
      end)
      assert.matches("^wsync: waiting for the trainer ranks to register: 1 of 4 so far %(ranks 0, 2, 3 missing%): "
        .. "0 s so far, deadline 0.05 s %(timeouts.registration%)\n", said)
    end)
  end)

  describe("a lost rank", function()
    it("fails the session before its last step, naming the rank and the phase; its first reason stays", function()
      local session = session_of()
      local registry = registry_for(4, session)
      registry:lose(3, "connection closed")
      session.phase = "ready"
      registry:lose(3, "a second reason")
      registry:lose(2, "timed out")
      assert.are.equal(2, #session.failures)
      local err = session.failures[1]
      assert.are.equal("TRAINER_LOST", err.code)
      assert.are.equal("trainer rank 3 was lost during registration: connection closed", err.message)
      assert.are.equal(3, err.rank)
      assert.are.equal("registration", err.phase)
      -- (The lowest rank lost, whatever the order.)
      assert.are.equal("trainer rank 2 was lost during ready: timed out", registry:lost_error().message)
      assert.is_true(registry:any_lost())
      assert.is_true(registry:lost_before_stop(3))
      assert.is_false(registry:lost_before_stop(2), "lost after the session stopped")
      assert.is_false(registry:lost_before_stop(0))
    end)

    it("leaves the failure to a round in progress, and is no failure once the steps are done", function()
      local session = session_of(1)
      local registry = registry_for(2, session)
      session.in_round, session.phase = true, "publish"
      registry:lose(1, "connection closed")
      assert.are.same({}, session.failures)
      assert.are.equal("trainer rank 1 was lost during publish: connection closed", registry:lost_error().message)
      session.in_round, session.rounds = false, 1
      registry:lose(0, "exited")
      assert.are.same({}, session.failures)
      assert.is_nil(registry:lost_error())
    end)

    it("names the ranks without something", function()
      local registry = registry_for(4, session_of())
      local text, missing = registry:ranks_without(function(rank)
        return rank ~= 1
      end)
      assert.are.equal("rank 1", text)
      assert.are.same({ 1 }, missing)
      text, missing = registry:ranks_without(function(rank)
        return rank == 1 or rank == 2
      end)
      assert.are.equal("ranks 0, 3", text)
      assert.are.same({ 0, 3 }, missing)
    end)
  end)

  describe("the endpoint's options", function()
    it("listen where the recipe says, with its token, and serve the registry's handlers", function()
      local session = session_of()
      local registry = registry_for(2, session)
      local options = registry:endpoint_options({ endpoint = "/tmp/x.sock", tcp = "127.0.0.1:0" }, "secret")
      assert.are.equal("/tmp/x.sock", options.path)
      assert.are.equal("127.0.0.1:0", options.tcp)
      assert.are.equal("secret", options.token)
      local viewer = peer("viewer")
      assert.is_function(options.handlers_for(viewer).publish)
      local said = captured(viewer.on_slow, "state", 6, 30)
      assert.are.equal("wsync: waiting for viewer to answer state: 6 s so far, deadline 30 s (phase registration)\n",
        said)
    end)

    it("name a rank that does not answer, lose a rank whose connection ends, and drop a viewer's", function()
      local session = session_of()
      local registry = registry_for(2, session)
      local options = registry:endpoint_options({})
      local peers = register_all(registry, session, 2)
      options.handlers_for(peers[1])
      local said = captured(peers[1].on_slow, "callback", 12, 60)
      assert.are.equal("wsync: waiting for trainer rank 1 (pid 101) to answer callback: 12 s so far, deadline 60 s "
        .. "(phase registration)\n", said)
      said = captured(function()
        options.on_lost(peer("viewer"), "closed")
        options.on_lost(peer("viewer"), "a frame too long", true)
        options.on_lost(peers[1], "connection closed")
      end)
      assert.are.equal("wsync: dropped the connection of viewer: a frame too long\n", said)
      assert.are.equal("TRAINER_LOST", session.failures[1].code)
      assert.are.equal(1, session.failures[1].rank)
    end)

    it("fail the session for a rank's malformed request, and only drop a viewer's", function()
      local session = session_of()
      local registry = registry_for(2, session)
      local options = registry:endpoint_options({})
      local peers = register_all(registry, session, 2)
      local viewer = peer("viewer")
      local said = captured(function()
        options.on_bad_request(viewer, "state", "payload.x: unknown field")
        options.on_bad_request(peers[0], "publish", "payload.step: not an integer")
        options.on_refused("refused a connection: wrong token")
      end)
      assert.are.equal("wsync: dropped the connection of viewer: malformed request: payload.x: unknown field\n"
        .. "wsync: refused a connection: wrong token\n", said)
      assert.are.equal("malformed request: payload.x: unknown field", viewer.closed)
      assert.are.equal("malformed request: payload.step: not an integer", peers[0].closed)
      local err = session.failures[1]
      assert.are.equal("BAD_MESSAGE", err.code)
      assert.are.equal("trainer rank 0 (peer 0) sent a malformed request: payload.step: not an integer", err.message)
      assert.are.equal(0, err.rank)
    end)
  end)

  describe("the publish collective", function()
    it("waits for every rank's call, and answers them all with the same result", function()
      local session = session_of()
      local registry = registry_for(2, session)
      local peers = register_all(registry, session, 2)
      local results = {}
      async.run_async(function()
        local calls = {}
        for rank = 0, 1 do
          calls[rank] = async.start(registry:handlers(peers[rank]).publish, { step = 7 })
        end
        assert.is_true(registry:await_publish({ train_step = 5, publish = 5 }, false))
        assert.are.equal(7, registry:publishing_step(4))
        local waits = registry:waits(0)
        assert.is_true(waits.train_step > 0 and waits.publish_wait >= 0)
        registry:answer({ model_version = 5 })
        session.condition:notify()
        for rank = 0, 1 do
          local ok, result = calls[rank]()
          assert(ok, result)
          results[rank] = result
        end
      end)
      assert.are.same({ model_version = 5 }, results[0])
      assert.are.equal(results[0], results[1])
      assert.are.same({}, registry.publishing)
    end)

    it("joins the ranks' generation requests in rank order, gives each its own share, refuses mixed sampling",
      function()
        local session = session_of()
        function session.generates()
          return true
        end
        local registry = registry_for(3, session)
        local peers = register_all(registry, session, 3)
        local results = {}
        async.run_async(function()
          local calls = {}
          local asks = { [0] = { prompts = { { 1, 2 }, { 3 } }, sampling = { max_tokens = 4 } }, [1] = nil,
            [2] = { prompts = { { 9 } }, sampling = { max_tokens = 4 } } }
          for rank = 0, 2 do
            calls[rank] = async.start(registry:handlers(peers[rank]).publish, { step = 7, generate = asks[rank] })
          end
          assert.is_true(registry:await_publish({ train_step = 5, publish = 5 }, false))
          local request, shares = registry:generation_request()
          assert.are.same({ prompts = { { 1, 2 }, { 3 }, { 9 } }, sampling = { max_tokens = 4 } }, request)
          assert.are.same({ [0] = { first = 1, count = 2 }, [2] = { first = 3, count = 1 } }, shares)
          registry.publishing[2].generate.sampling = { max_tokens = 5 }
          local err = error_of(registry.generation_request, registry)
          assert.are.equal("PUBLISH_MISMATCH", err.code)
          assert.matches("trainer ranks 0 and 2 ask publish to generate with different sampling", err.message, 1, true)
          registry:answer({ model_version = 5 }, nil, { [2] = { generation = "{}" } })
          session.condition:notify()
          for rank = 0, 2 do
            local ok, result = calls[rank]()
            assert(ok, result)
            results[rank] = result
          end
        end)
        assert.are.same({ model_version = 5 }, results[0])
        assert.are.same({ model_version = 5, generation = "{}" }, results[2])
      end)

    it("refuses a rank's request to generate where the schedule does not generate after publish", function()
      local session = session_of()
      function session.generates()
        return false
      end
      local registry = registry_for(1, session)
      local peers = register_all(registry, session, 1)
      local err = error_of(registry:handlers(peers[0]).publish, { step = 7, generate = { prompts = { { 1 } } } })
      assert.are.equal("INVALID_ARGUMENT", err.code)
      assert.are.equal("generate", err.field)
      assert.are.same({}, registry.publishing)
    end)

    it("passes an error to every rank, refuses ranks that disagree on the step", function()
      local session = session_of()
      local registry = registry_for(2, session)
      local peers = register_all(registry, session, 2)
      local failed = {}
      async.run_async(function()
        local calls = {}
        for rank = 0, 1 do
          calls[rank] = async.start(registry:handlers(peers[rank]).publish, { step = 7 + rank })
        end
        registry:await_publish({ train_step = 5, publish = 5 }, false)
        local err = error_of(registry.publishing_step, registry, 4)
        assert.are.equal("PUBLISH_MISMATCH", err.code)
        assert.are.equal("trainer ranks publish different steps (7 and 8)", err.message)
        registry:answer(nil, err)
        session.condition:notify()
        for rank = 0, 1 do
          local ok, raised = calls[rank]()
          assert.is_false(ok)
          failed[rank] = raised
        end
      end)
      assert.are.equal("PUBLISH_MISMATCH", failed[0].code)
      assert.are.equal(failed[0], failed[1])
    end)

    it("refuses a publish from a connection that is no rank, after the steps, and twice", function()
      local session = session_of(1)
      local registry = registry_for(2, session)
      local peers = register_all(registry, session, 2)
      local err = error_of(registry:handlers(peer("viewer")).publish, { step = 1 })
      assert.are.equal("NOT_REGISTERED", err.code)
      async.run_async(function()
        local call = async.start(registry:handlers(peers[0]).publish, { step = 1 })
        err = error_of(registry:handlers(peers[0]).publish, { step = 1 })
        assert.are.equal("PUBLISH_TWICE", err.code)
        assert.are.equal("rank 0 called publish again before its answer", err.message)
        registry:answer({})
        session.condition:notify()
        assert.is_true((call()))
      end)
      session.rounds = 1
      err = error_of(registry:handlers(peers[1]).publish, { step = 2 })
      assert.are.equal("STEPS_DONE", err.code)
      assert.are.equal("rank 1 called publish after the session's 1 steps (trainer.steps in the recipe)", err.message)
    end)

    it("times out: no rank called within train_step, or not every rank within publish of the first", function()
      local session = session_of()
      local registry = registry_for(3, session)
      local peers = register_all(registry, session, 3)
      local outcomes = {}
      async.run_async(function()
        outcomes[1] = { registry:await_publish({ train_step = 0.05, publish = 5 }, true) }
        local call = async.start(registry:handlers(peers[1]).publish, { step = 1 })
        outcomes[2] = { registry:await_publish({ train_step = 5, publish = 0.05 }, false) }
        registry:answer(nil, outcomes[2][2])
        session.condition:notify()
        call()
      end)
      assert.is_false(outcomes[1][1])
      assert.are.equal("PUBLISH_TIMEOUT", outcomes[1][2].code)
      assert.are.equal("no trainer rank called publish within 0.05 s of the last publication (timeouts.train_step)",
        outcomes[1][2].message)
      assert.are.equal("training", outcomes[1][2].phase)
      assert.are.equal("trainer ranks 0, 2 did not call publish within 0.05 s of the first rank's call "
        .. "(timeouts.publish)", outcomes[2][2].message)
      assert.are.equal(0, outcomes[2][2].rank)
      assert.are.equal("publish", outcomes[2][2].phase)
    end)

    it("ends the wait when a rank is lost or the session stops", function()
      local outcomes = {}
      async.run_async(function()
        local session = session_of()
        local registry = registry_for(2, session)
        register_all(registry, session, 2)
        session.in_round = true -- (lost without failing the session: the wait sees it)
        loop.after(10, function()
          registry:lose(1, "connection closed")
        end)
        outcomes[1] = { registry:await_publish({ train_step = 5, publish = 5 }, false) }
        session = session_of()
        registry = registry_for(2, session)
        loop.after(10, function()
          session:fail("stopped")
        end)
        outcomes[2] = { registry:await_publish({ train_step = 5, publish = 5 }, false) }
      end)
      assert.is_false(outcomes[1][1])
      assert.are.equal("trainer rank 1 was lost during registration: connection closed", outcomes[1][2].message)
      assert.are.same({ false, "stopped" }, outcomes[2])
    end)

    it("says which ranks did not call publish yet", function()
      loop.PROGRESS_AFTER = 0.02
      local said = captured(async.run_async, function()
        local session = session_of()
        local registry = registry_for(3, session)
        local peers = register_all(registry, session, 3)
        local call = async.start(registry:handlers(peers[1]).publish, { step = 1 })
        registry:await_publish({ train_step = 5, publish = 0.05 }, false)
        registry:answer({})
        session.condition:notify()
        call()
      end)
      assert.matches("^wsync: waiting for trainer ranks 0, 2 to call publish %(rank 1 did%): 0 s so far, deadline "
        .. "0.05 s %(timeouts.publish%)\n", said)
    end)
  end)

  describe("the end", function()
    -- Synthetic trainer processes as the registry asks about them.
    local function trainers(spawned, exited)
      return {
        spawned = function(_, rank)
          return spawned[rank] == true
        end,
        exit_of = function(_, rank)
          return exited[rank] and { code = 0, signal = 0 } or nil
        end,
        describe = function(_, rank)
          return exited[rank] and "code 0" or nil
        end,
      }
    end

    it("tells every connected rank that is not busy the session's failure", function()
      local session = session_of()
      local registry = registry_for(3, session)
      local peers = register_all(registry, session, 3)
      peers[1].closed = "gone"
      peers[2].inflight.pending = true
      async.run_async(function()
        registry:tell_failure(require("wsync.errors").new("PUBLISH_FAILED", "it failed", { rank = 1 }), 7)
      end)
      assert.are.same({ { cmd = "abort", payload = { code = "PUBLISH_FAILED", message = "it failed", rank = 1 },
        timeout = 7 } }, peers[0].requests)
      assert.are.same({}, peers[1].requests)
      assert.are.same({}, peers[2].requests)
    end)

    it("waits for the ranks to leave: a process to exit, a connection to close", function()
      local session = session_of()
      local registry = registry_for(2, session)
      local peers = register_all(registry, session, 2)
      local exited = {}
      local left
      async.run_async(function()
        loop.after(10, function()
          exited[0] = true
          peers[1].closed = "closed"
          session.condition:notify()
        end)
        left = registry:await_leaving(5, trainers({ [0] = true }, exited))
      end)
      assert.is_true(left)
    end)

    it("names an external rank still connected when the time is up; a rank lost before the stop need not leave",
      function()
        local session = session_of()
        local registry = registry_for(3, session)
        local peers = register_all(registry, session, 3)
        registry:lose(0, "hung") -- (it fails the session: the session stopped)
        local left
        local said = captured(async.run_async, function()
          left = registry:await_leaving(0.05, trainers({ [0] = true, [1] = true }, {}))
        end)
        assert.is_false(left)
        assert.are.equal("wsync: trainer rank 2 is still connected 0.05 s after the session's end "
          .. "(timeouts.shutdown): closing its connection\n", said)
        peers[2].closed = "closed"
        async.run_async(function()
          assert.is_true(registry:await_leaving(0.05, trainers({ [0] = true, [1] = true }, { [1] = true })))
        end)
      end)

    it("shows each rank in the session's state", function()
      local session = session_of()
      local registry = registry_for(2, session)
      register_all(registry, session, 2)
      registry:lose(1, "connection closed")
      assert.are.same({
        { rank = 0, device = "GPU-0", pid = 100, publishing = false },
        { rank = 1, device = "GPU-1", pid = 101, publishing = false, lost = "connection closed", exited = "code 0" },
      }, registry:state(trainers({}, { [1] = true })))
      assert.are.equal("the state", registry:handlers(peer("viewer")).state())
    end)
  end)
end)
