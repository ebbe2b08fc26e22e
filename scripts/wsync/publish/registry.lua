--- The trainer ranks as a session's control endpoint knows them, and the
--- publish collective: which connection registered as which rank and what
--- it registered, which ranks were lost and why, and each rank's call of
--- `publish` waiting for the round's one answer. It opens the endpoint with
--- its options (the agents' requests: register, state, publish; what a
--- malformed message or a lost connection does), waits for every rank to
--- register, then, round by round, for every rank to call publish, answers
--- them all, and at the end tells them the session's failure and waits for
--- them to leave. Every wait says which ranks it waits for.
---
--- Once every rank registered, wsync.publish.ranks drives them
--- (Registry:ranks); their processes, when synthetic, are
--- wsync.publish.trainers's. The session (wsync.publish.session) owns the
--- phase, the rounds and the failure: the registry reads them and asks it
--- (wsync.RegistrySession).
local uv = require("luv")
local console = require("wsync.publish.console")
local endpoint_module = require("wsync.control.endpoint")
local errors = require("wsync.errors")
local loop = require("wsync.loop")
local messages = require("wsync.control.messages")
local plan_module = require("wsync.plan")
local ranks_module = require("wsync.publish.ranks")

local M = {}

local say = console.say

--- What the registry reads of its session and asks it.
---@class wsync.RegistrySession
---@field condition wsync.Condition  every wait of the session is on it
---@field phase string               what the session does now ("registration", "publish", ...)
---@field stopped wsync.Error?       why nothing more is published, once so
---@field in_round boolean?          a round is in progress: its own failure is the one every rank hears
---@field ready boolean?             the opening is done: registered ranks may go on
---@field versions {committed: integer}
---@field steps_done fun(self): boolean     every publication the recipe asks for was served
---@field fail fun(self, err: wsync.Error)  stops the session with `err`
---@field state fun(self): table            the snapshot an attached viewer reads
---@field where fun(self): string           where the session is, for a line that says what it waits for

---@class wsync.Registry
---@field registered table<integer, {info: table, peer: wsync.Peer}>  by rank: what it registered, its connection
---@field lost table<integer, {reason: string, phase: string, before_stop: boolean}>  by rank
---@field publishing table<integer, table>  by rank: its call of publish waiting for the answer
local Registry = {}
Registry.__index = Registry

--- An empty registry for `session`, of `options.world` ranks registering
--- against `options.plan`; `options.steps`: the recipe's trainer.steps, for
--- the refusal of a publish after them; `options.announce`: say each rank's
--- registration (external ranks; synthetic ones are the host's own).
---@param session wsync.RegistrySession
---@param options {world: integer, plan: wsync.Plan, steps: integer, announce: boolean?}
---@return wsync.Registry
function M.new(session, options)
  return setmetatable({
    session = session, condition = session.condition, world = options.world, plan = options.plan,
    steps = options.steps, announce = options.announce, registered = {}, lost = {}, publishing = {},
    mismatch = nil,
  }, Registry)
end

local function count(table_value)
  local n = 0
  for _ in pairs(table_value) do
    n = n + 1
  end
  return n
end

--- How many ranks registered.
---@return integer
function Registry:count()
  return count(self.registered)
end

--- The ranks of 0 .. world - 1 for which `has(rank)` is false, as text
--- ("rank 1", "ranks 0, 3"), and as a list.
---@param has fun(rank: integer): boolean
---@return string, integer[]
function Registry:ranks_without(has)
  local missing = {}
  for rank = 0, self.world - 1 do
    if not has(rank) then
      missing[#missing + 1] = rank
    end
  end
  return string.format("rank%s %s", #missing > 1 and "s" or "", table.concat(missing, ", ")), missing
end

--- The trainer rank the connection `peer` registered as; nil for a
--- connection that registered none (an attached viewer).
---@param peer wsync.Peer
---@return integer?
function Registry:rank_of(peer)
  for rank, registered in pairs(self.registered) do
    if registered.peer == peer then
      return rank
    end
  end
  return nil
end

--- A registered rank is gone: its connection ended (the rank exited or was
--- killed, a command to it timed out, it broke the protocol). Before the
--- session's last step that fails the session, naming the rank and the
--- phase; during a publication round the round's own failure is the
--- session's (the round cannot finish without the rank, and every rank
--- hears that error). A rank is lost once: the first reason stays.
---@param rank integer
---@param reason string
function Registry:lose(rank, reason)
  if self.lost[rank] then
    return
  end
  local session = self.session
  -- (`before_stop`: lost while the session still ran, so not a rank that
  -- heard the session's failure and went; it may be stopped, or hung.)
  self.lost[rank] = { reason = reason, phase = session.phase, before_stop = session.stopped == nil }
  if not session:steps_done() and not session.in_round then
    session:fail(errors.new("TRAINER_LOST", string.format("trainer rank %d was lost during %s: %s", rank,
      session.phase, reason), { phase = session.phase, rank = rank }))
  end
  self.condition:notify()
end

--- The lowest rank lost before the session's last step, as an error
--- (TRAINER_LOST); nil when none was.
---@return wsync.Error?
function Registry:lost_error()
  local rank = nil
  for lost_rank in pairs(self.lost) do
    rank = math.min(rank or lost_rank, lost_rank)
  end
  if rank == nil or self.session:steps_done() then
    return nil
  end
  local lost = self.lost[rank]
  return errors.new("TRAINER_LOST", string.format("trainer rank %d was lost during %s: %s", rank, lost.phase,
    lost.reason), { phase = lost.phase, rank = rank })
end

--- Whether any rank was lost.
---@return boolean
function Registry:any_lost()
  return next(self.lost) ~= nil
end

--- Whether rank `rank` was lost while the session still ran (not after it
--- heard the session's failure): it may be stopped, or hung.
---@param rank integer
---@return boolean
function Registry:lost_before_stop(rank)
  local lost = self.lost[rank]
  return lost ~= nil and lost.before_stop
end

--- The requests agents send to the host, for connection `peer` (their
--- payloads are checked against wsync.control.messages before a handler
--- runs).
---@param peer wsync.Peer
---@return table<string, function>
function Registry:handlers(peer)
  local session = self.session
  return {
    register = function(payload)
      local rank, world = payload.rank, self.world
      if rank >= world then
        errors.raise("REGISTER", string.format("rank %d outside the recipe's %d trainer ranks", rank, world))
      end
      if payload.world ~= world then
        errors.raise("REGISTER", string.format("rank %d says world %d; the recipe says %d", rank, payload.world,
          world), { rank = rank })
      end
      local earlier = self.registered[rank]
      if earlier then
        -- (A rank that was lost has failed the session already, unless its
        -- steps were done: a session never takes a rank back.)
        errors.raise("REGISTER", string.format("rank %d registered twice (pid %s, then pid %s)%s", rank,
          tostring(earlier.info.pid), tostring(payload.pid), self.lost[rank]
          and string.format("; its first connection was lost (%s) and a session does not take a rank back",
            self.lost[rank].reason) or ""), { rank = rank })
      end
      if session.stopped then
        error(session.stopped, 0)
      end
      -- What it registered against the plan (a missing, extra or wrongly
      -- shaped tensor): once every rank has registered, before the runtime
      -- starts, the session fails with the lowest rank's mismatch and every
      -- rank hears it (Registry:await_registration).
      local fits, mismatch = pcall(ranks_module.check_tensors, self.plan, rank, payload.tensors)
      if not fits and (self.mismatch == nil or rank < self.mismatch.rank) then
        self.mismatch = mismatch
      end
      self.registered[rank] = { info = payload, peer = peer }
      if self.announce then
        say("trainer rank %d registered (pid %d, device %s): %d of %d", rank, payload.pid, payload.device.uuid,
          self:count(), world)
      end
      self.condition:notify()
      self.condition:wait(function()
        return session.ready or session.stopped ~= nil
      end)
      if session.stopped then
        error(session.stopped, 0)
      end
      return { plan = plan_module.summary(self.plan), model_version = session.versions.committed }
    end,
    state = function()
      return session:state()
    end,
    publish = function(payload)
      -- The rank this connection registered as, not whatever the payload says.
      local rank = self:rank_of(peer)
      if rank == nil then
        errors.raise("NOT_REGISTERED", "publish from a connection that did not register a trainer rank")
      end
      if session.stopped then
        error(session.stopped, 0)
      end
      if session:steps_done() then
        errors.raise("STEPS_DONE", string.format("rank %d called publish after the session's %d steps "
          .. "(trainer.steps in the recipe)", rank, self.steps), { rank = rank, phase = "publish" })
      end
      if self.publishing[rank] then
        errors.raise("PUBLISH_TWICE", string.format("rank %d called publish again before its answer", rank),
          { rank = rank })
      end
      if payload.generate and not session:generates() then
        errors.raise("INVALID_ARGUMENT", "publish was asked to generate, and the recipe's schedule has no \"generate\" "
          .. "step after \"publish\"", { rank = rank, field = "generate" })
      end
      local waiter = { step = payload.step, called = uv.hrtime() / 1e9, generate = payload.generate }
      self.publishing[rank] = waiter
      self.condition:notify()
      self.condition:wait(function()
        return waiter.done
      end)
      if waiter.error then
        error(waiter.error, 0)
      end
      return waiter.result
    end,
  }
end

--- The control endpoint's options (wsync.control.endpoint.listen) for the
--- agents: where it listens (`control`, the recipe's control: endpoint,
--- tcp), `token`, the handlers and message shapes, and what a malformed
--- message or a lost connection does. A trainer rank that sends a malformed
--- request fails the session; a connection that registered no rank (an
--- attached viewer) is dropped and the session goes on.
---@param control table
---@param token string?
---@return table
function Registry:endpoint_options(control, token)
  local session = self.session
  return {
    handlers_for = function(peer)
      -- (A rank that does not answer is named while the host waits.)
      peer:watch(function(cmd, waited, deadline)
        local rank = self:rank_of(peer)
        say("waiting for %s to answer %s: %.0f s so far, deadline %g s (%s)", rank and string.format("trainer rank %d "
          .. "(pid %s)", rank, tostring(self.registered[rank].info.pid)) or peer.name, cmd, waited, deadline,
          session:where())
      end)
      return self:handlers(peer)
    end,
    schemas = { requests = messages.to_host, results = messages.from_agent },
    path = control.endpoint,
    tcp = control.tcp,
    token = token,
    on_bad_request = function(peer, _, reason)
      local rank = self:rank_of(peer)
      if rank == nil then
        -- Not a trainer rank of this session: it goes, the session goes on.
        say("dropped the connection of %s: malformed request: %s", peer.name, reason)
      else
        session:fail(errors.new("BAD_MESSAGE", string.format("trainer rank %d (%s) sent a malformed "
          .. "request: %s", rank, peer.name, reason), { rank = rank, phase = session.phase }))
      end
      peer:close("malformed request: " .. reason)
    end,
    on_lost = function(peer, reason, violation)
      -- A trainer rank leaving matters; an attached viewer may come and go.
      local rank = self:rank_of(peer)
      if rank then
        self:lose(rank, reason)
      elseif violation then
        say("dropped the connection of %s: %s", peer.name, reason)
      end
    end,
    on_refused = function(reason)
      say("%s", reason)
    end,
  }
end

--- Opens the control endpoint for the agents where `recipe.control` says,
--- with the recipe's token or (a TCP endpoint) one drawn here, and says where
--- it listens. Returns the endpoint (wsync.control.endpoint); raises ENDPOINT
--- for a token the recipe names that cannot be read.
---@param recipe table
---@return table
function Registry:listen(recipe)
  -- (A token the recipe gives stays where it is: the ranks read it there
  -- too. One the host draws is printed.)
  local token, token_place, field = require("wsync.recipe").control_token(recipe)
  if not token and field then
    errors.raise("ENDPOINT", token_place, { field = field })
  end
  local endpoint = endpoint_module.listen(self:endpoint_options(recipe.control or {}, token))
  say("control endpoint %s", endpoint.path)
  if endpoint.tcp_endpoint then
    if token then
      say("control endpoint for other hosts %s (its token is in %s)", endpoint.tcp_address, token_place)
    else
      say("control endpoint for other hosts %s", endpoint.tcp_endpoint)
    end
  end
  return endpoint
end

--- Waits until every rank registered, up to `seconds`
--- (timeouts.registration), or until `exited()` (a synthetic trainer
--- process exited) or the session stopped. Raises the session's failure,
--- the lowest rank's registration that does not fit the plan, or STARTUP
--- when not every rank registered.
---@param seconds number
---@param exited fun(): boolean
function Registry:await_registration(seconds, exited)
  local session, world = self.session, self.world
  console.wait_for(self.condition, seconds, function()
    return self:count() == world or exited() or session.stopped ~= nil
  end, function()
    return string.format("the trainer ranks to register: %d of %d so far (%s missing)", self:count(), world,
      (self:ranks_without(function(rank)
        return self.registered[rank] ~= nil
      end))), "(timeouts.registration)"
  end)
  if session.stopped then
    error(session.stopped, 0)
  end
  if self.mismatch then
    error(self.mismatch, 0)
  end
  if self:count() ~= world then
    errors.raise("STARTUP", string.format("%d of %d trainer ranks registered within %g s "
      .. "(timeouts.registration)%s", self:count(), world, seconds, exited() and " (a trainer process exited)" or ""))
  end
end

--- The registered ranks as wsync.publish.ranks drives them (`gather`: the
--- transport's, wsync.publish.ranks.new). Every rank must have registered.
---@param gather "shared"|"broadcast"|nil
---@return wsync.Ranks
function Registry:ranks(gather)
  return ranks_module.new(self.registered, self.world, gather)
end

--- The callbacks every rank registered (a set of names): a schedule step
--- runs a callback only when every rank has it.
---@return table<string, boolean>
function Registry:common_callbacks()
  local common = nil
  for rank = 0, self.world - 1 do
    local names = {}
    for _, name in ipairs(self.registered[rank].info.callbacks or {}) do
      if common == nil or common[name] then
        names[name] = true
      end
    end
    common = names
  end
  return common or {}
end

--- Waits until every rank called publish (true), or the session cannot go
--- on (false, and why): it stopped (its failure), a rank was lost
--- (TRAINER_LOST), or the ranks did not call publish in time
--- (PUBLISH_TIMEOUT): within `timeouts.train_step` no rank called it, or
--- within `timeouts.publish` of the first rank's call not every rank did.
--- `published`: a publication was done already (the train_step wait counts
--- from it, else from the session's start).
---@param timeouts {train_step: number, publish: number}
---@param published boolean
---@return boolean, wsync.Error?
function Registry:await_publish(timeouts, published)
  local session, world = self.session, self.world
  local started, first_call = uv.now(), nil
  local expired = nil
  local timer = nil
  local function arm(seconds)
    loop.cancel(timer)
    timer = loop.after(seconds * 1000, function()
      self.condition:notify()
    end)
  end
  -- (What it waits for, said after 5 s and each time the wait doubled.)
  local progress = loop.progress(function(waited)
    say("waiting for the trainer ranks' next publish (the training step; no rank called it yet): %.0f s so far, "
      .. "deadline %g s (timeouts.train_step)", waited, timeouts.train_step)
  end)
  arm(timeouts.train_step)
  self.condition:wait(function()
    if count(self.publishing) == world or session.stopped or self:lost_error() then
      return true
    end
    local now = uv.now()
    if next(self.publishing) and not first_call then
      first_call = now
      arm(timeouts.publish)
      loop.cancel(progress)
      progress = loop.progress(function(waited)
        say("waiting for trainer %s to call publish (%s did): %.0f s so far, deadline %g s (timeouts.publish)",
          (self:ranks_without(function(rank)
            return self.publishing[rank] ~= nil
          end)), (self:ranks_without(function(rank)
            return self.publishing[rank] == nil
          end)), waited, timeouts.publish)
      end)
    end
    if first_call and now - first_call >= timeouts.publish * 1000 then
      expired = "publish"
    elseif not first_call and now - started >= timeouts.train_step * 1000 then
      expired = "train_step"
    end
    return expired ~= nil
  end)
  loop.cancel(timer)
  loop.cancel(progress)
  if count(self.publishing) == world and not session.stopped then
    return true
  end
  local err = session.stopped or self:lost_error()
  if not err and expired == "publish" then
    local missing, ranks = self:ranks_without(function(rank)
      return self.publishing[rank] ~= nil
    end)
    err = errors.new("PUBLISH_TIMEOUT", string.format("trainer %s did not call publish within %g s of the first "
      .. "rank's call (timeouts.publish)", missing, timeouts.publish), { phase = "publish", rank = ranks[1] })
  elseif not err then
    err = errors.new("PUBLISH_TIMEOUT", string.format("no trainer rank called publish within %g s of %s "
      .. "(timeouts.train_step)", timeouts.train_step, published and "the last publication" or
      "the session's start"), { phase = "training" })
  end
  return false, err
end

--- The waits before a round, from `since` (seconds of uv.hrtime) until now
--- (wsync.publish.report's begin_round): `train_step` to the first rank's
--- call of publish, `publish_wait` from then to the last rank's (none yet:
--- it runs to now).
---@param since number
---@return {started: number, train_step: number, publish_wait: number?}
function Registry:waits(since)
  local first, last = nil, nil
  for _, waiter in pairs(self.publishing) do
    first = math.min(first or waiter.called, waiter.called)
    last = math.max(last or waiter.called, waiter.called)
  end
  local now = uv.hrtime() / 1e9
  if not first then
    return { started = since, train_step = now - since }
  end
  first = math.max(first, since)
  return { started = since, train_step = first - since, publish_wait = (count(self.publishing) == self.world
    and math.max(last, first) or now) - first }
end

--- The trainer step the ranks publish (they must agree: PUBLISH_MISMATCH
--- otherwise); `committed` + 1 when they do not say. Every rank called
--- publish.
---@param committed integer
---@return integer
function Registry:publishing_step(committed)
  local step = nil
  for rank = 0, self.world - 1 do
    local waiter = self.publishing[rank]
    step = step or waiter.step
    if waiter.step ~= step then
      errors.raise("PUBLISH_MISMATCH", string.format("trainer ranks publish different steps (%s and %s)",
        tostring(step), tostring(waiter.step)), { rank = rank })
    end
  end
  return step or (committed + 1)
end

--- What the ranks waiting in publish asked the schedule's "generate" step
--- to generate, as one request to the runtime: every rank's prompts in rank
--- order, and the sampling they all give; nil when none asked. Returns the
--- request and, by rank, which of its outputs are the rank's ({first,
--- count}). Ranks that ask with different sampling are refused.
---@return table? request, table<integer, {first: integer, count: integer}>? shares
function Registry:generation_request()
  local prompts, shares, sampling, sampled_by = {}, {}, nil, nil
  local util = require("wsync.util")
  for rank = 0, self.world - 1 do
    local waiter = self.publishing[rank]
    local asked = waiter and waiter.generate
    if asked then
      local this = util.json(asked.sampling or {})
      if sampling and this ~= sampling then
        errors.raise("PUBLISH_MISMATCH", string.format("trainer ranks %d and %d ask publish to generate with "
          .. "different sampling (%s and %s)", sampled_by, rank, sampling, this), { rank = rank })
      end
      sampling, sampled_by = this, sampled_by or rank
      shares[rank] = { first = #prompts + 1, count = #asked.prompts }
      for _, prompt in ipairs(asked.prompts) do
        prompts[#prompts + 1] = prompt
      end
    end
  end
  if #prompts == 0 then
    return nil
  end
  return { prompts = prompts, sampling = require("cjson").decode(sampling) }, shares
end

--- Answers every rank waiting in publish with `result` or `err`; the next
--- calls of publish are the next round's. (The session notifies.)
--- `per_rank` (by rank, optional): fields added to that rank's result.
---@param result table?
---@param err wsync.Error?
---@param per_rank table<integer, table>?
function Registry:answer(result, err, per_rank)
  for rank = 0, self.world - 1 do
    local waiter = self.publishing[rank]
    if waiter then
      local own = result
      if result and per_rank and per_rank[rank] then
        own = require("wsync.util").merged(result, per_rank[rank])
      end
      waiter.result, waiter.error, waiter.done = own, err, true
    end
  end
  self.publishing = {}
end

--- Tells every rank still connected and not busy the session's failure
--- `err` (an `abort` request, `timeout` s each, at once; the rank raises it
--- from its next publish).
---@param err wsync.Error
---@param timeout number
function Registry:tell_failure(err, timeout)
  local told = errors.fields(err)
  for _, registered in pairs(self.registered) do
    local peer = registered.peer
    if not peer.closed and not peer.inflight.pending then
      loop.spawn(function()
        pcall(peer.request, peer, "abort", told, timeout)
      end)
    end
  end
end

--- Waits up to `seconds` (timeouts.shutdown) for every rank to leave after
--- the session's end: a synthetic rank's process exits (`trainers`,
--- wsync.publish.trainers; once the session stopped, not one lost while it
--- ran: it may be stopped, or hung), an external rank disconnects. Says
--- which external ranks are still connected when the time is up. Returns
--- whether all left.
---@param seconds number
---@param trainers wsync.Trainers
---@return boolean
function Registry:await_leaving(seconds, trainers)
  local session = self.session
  local function gone(rank)
    local spawned = trainers:spawned(rank)
    if spawned and not trainers:exit_of(rank) and not (session.stopped and self:lost_before_stop(rank)) then
      return false
    end
    local registered = self.registered[rank]
    return not (registered and not spawned and not registered.peer.closed)
  end
  local left = console.wait_for(self.condition, seconds, function()
    for rank = 0, self.world - 1 do
      if not gone(rank) then
        return false
      end
    end
    return true
  end, function()
    return string.format("trainer %s to leave after the session's end", (self:ranks_without(gone))),
      "(timeouts.shutdown)"
  end)
  if not left then
    for rank = 0, self.world - 1 do
      local registered = self.registered[rank]
      if registered and not trainers:spawned(rank) and not registered.peer.closed then
        say("trainer rank %d is still connected %g s after the session's end (timeouts.shutdown): closing its "
          .. "connection", rank, seconds)
      end
    end
  end
  return left
end

--- Each registered rank as the session's state shows it, in rank order:
--- {rank, device, pid, publishing, lost (why), exited (how its process
--- exited, a synthetic rank's: `trainers`, wsync.publish.trainers)}.
---@param trainers wsync.Trainers
---@return table[]
function Registry:state(trainers)
  local ranks = {}
  for rank, registered in pairs(self.registered) do
    ranks[#ranks + 1] = { rank = rank, device = registered.info.device.uuid, pid = registered.info.pid,
      publishing = self.publishing[rank] ~= nil, lost = self.lost[rank] and self.lost[rank].reason,
      exited = trainers:describe(rank) }
  end
  table.sort(ranks, function(a, b)
    return a.rank < b.rank
  end)
  return ranks
end

return M
