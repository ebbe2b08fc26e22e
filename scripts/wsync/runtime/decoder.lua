--- Generation in the reference runtime: a deterministic toy decoder, not a
--- language model, so that what generation does around publications can be
--- tested without a GPU. Its next token is a function of the resident
--- weights' digest and the context (the last tokens and the length), so a
--- weight change visibly changes what it emits; its log-probability of a
--- token is -(token % 7) / 8.
---
--- Requests stream, several in flight: `submit` queues them and a timer
--- advances every active request by one token per step, whenever the runtime
--- allows generation (weights awake, KV cache reserved, no update between
--- start and finish); `poll` returns what each produced since the last poll.
--- Every token is stamped with the model version committed when it was
--- produced, and a request's version spans ({version, first_token,
--- last_token}, token indices from 0) say which version produced which part.
--- Generation pauses and resumes as vLLM's does (M.PAUSE_MODES).
local digest = require("wsync.native.digest")
local errors = require("wsync.errors")
local loop = require("wsync.loop")
local uv = require("luv")

local M = {}

--- Most tokens one request may ask for.
M.MAX_TOKENS = 65536

--- Tokens of context the next token depends on (besides the length).
M.WINDOW = 8

---@class wsync.Decoder
---@field vocab integer
local Decoder = {}
Decoder.__index = Decoder

--- `options`: {vocab, step_ms, allowed = fn() -> boolean, version = fn() ->
--- integer, weights = fn() -> string (the resident weights' digest)}.
---@return wsync.Decoder
function M.new(options)
  return setmetatable({
    vocab = options.vocab or 1000, step_ms = options.step_ms or 1, allowed = options.allowed,
    version = options.version, weights = options.weights, requests = {}, active = {}, next_id = 1,
    done = loop.condition(), steps = 0,
  }, Decoder)
end

--- The token after `context` under weights digest `weights`.
---@param weights string
---@param context integer[]
---@param vocab integer
---@return integer
function M.next_token(weights, context, vocab)
  local first = math.max(1, #context - M.WINDOW + 1)
  local window = table.concat(context, ",", first, #context)
  local hex = digest.sha256_hex(weights .. "|" .. #context .. "|" .. window)
  return tonumber(hex:sub(1, 8), 16) % vocab
end

--- The log-probability the toy decoder gives its token.
function M.logprob(token)
  return -(token % 7) / 8
end

local function check_prompt(prompt, index)
  if type(prompt) ~= "table" or #prompt == 0 then
    errors.raise("INVALID_ARGUMENT", string.format("prompt %d is not a non-empty list of token ids", index))
  end
  for _, token in ipairs(prompt) do
    if type(token) ~= "number" or token < 0 or token % 1 ~= 0 then
      errors.raise("INVALID_ARGUMENT", string.format("prompt %d holds %s, not a token id", index, tostring(token)))
    end
  end
end

--- Queues requests ({prompt, max_tokens}); returns their ids. Each is stamped
--- with the version committed now (its dispatch).
---@param requests table[]
---@return integer[]
function Decoder:submit(requests)
  if type(requests) ~= "table" then
    errors.raise("INVALID_ARGUMENT", "submit needs a list of requests {prompt, max_tokens}")
  end
  local ids = {}
  for index, request in ipairs(requests) do
    check_prompt(request.prompt, index)
    local max_tokens = request.max_tokens or 16
    if type(max_tokens) ~= "number" or max_tokens < 1 or max_tokens > M.MAX_TOKENS or max_tokens % 1 ~= 0 then
      errors.raise("INVALID_ARGUMENT", string.format("request %d: max_tokens must be an integer from 1 to %d, got %s",
        index, M.MAX_TOKENS, tostring(max_tokens)))
    end
  end
  for _, request in ipairs(requests) do
    local context = {}
    for i, token in ipairs(request.prompt) do
      context[i] = token
    end
    local id = self.next_id
    self.next_id = id + 1
    self.requests[id] = { id = id, context = context, max_tokens = request.max_tokens or 16, tokens = {},
      logprobs = {}, spans = {}, polled = 0, done = false, model_version = self.version() }
    self.active[#self.active + 1] = id
    ids[#ids + 1] = id
  end
  self:_start()
  return ids
end

function Decoder:_start()
  if self.timer or #self.active == 0 then
    return
  end
  uv.update_time()
  self.timer = uv.new_timer()
  self.timer:start(self.step_ms, self.step_ms, function()
    local ok, err = pcall(self._step, self)
    if not ok then
      io.stderr:write("wsync: reference runtime: generation step failed: " .. tostring(err) .. "\n")
    end
  end)
end

function Decoder:_stop()
  if self.timer then
    loop.cancel(self.timer)
    self.timer = nil
  end
end

-- One token for every active request, when generation is allowed now.
function Decoder:_step()
  if self.paused or not self.allowed() then
    return
  end
  local weights, version = self.weights(), self.version()
  local still, finished = {}, false
  for _, id in ipairs(self.active) do
    local request = self.requests[id]
    local token = M.next_token(weights, request.context, self.vocab)
    request.context[#request.context + 1] = token
    request.tokens[#request.tokens + 1] = token
    request.logprobs[#request.logprobs + 1] = M.logprob(token)
    local n, last = #request.tokens - 1, request.spans[#request.spans]
    if last and last.version == version then
      last.last_token = n
    else
      -- (After a keep-mode pause across a new version: how its KV cache went
      -- on, recomputed under the new weights or kept from the old ones.)
      request.spans[#request.spans + 1] = { version = version, first_token = n, last_token = n,
        kv = last and request.resumed_kv or nil }
      request.resumed_kv = nil
    end
    if #request.tokens >= request.max_tokens then
      request.done, request.finish, finished = true, "length", true
    else
      still[#still + 1] = id
    end
  end
  self.active = still
  self.steps = self.steps + 1
  if #still == 0 then
    self:_stop()
  end
  if finished then
    self.done:notify()
  end
end

local function view(request, from)
  local tokens, logprobs = {}, {}
  for i = from + 1, #request.tokens do
    tokens[#tokens + 1] = request.tokens[i]
    logprobs[#logprobs + 1] = request.logprobs[i]
  end
  return {
    id = request.id, tokens = tokens, logprobs = logprobs, first_token = from, spans = request.spans,
    done = request.done, finish = request.finish, generated = #request.tokens, model_version = request.model_version,
  }
end

--- What each request (all, or those of `ids`) produced since the last poll,
--- with its version spans so far. A finished request is forgotten once polled.
---@param ids integer[]?
---@return table[]
function Decoder:poll(ids)
  local chosen = {}
  if ids and #ids > 0 then
    for _, id in ipairs(ids) do
      if not self.requests[id] then
        errors.raise("INVALID_ARGUMENT", "no request " .. tostring(id) .. " (finished ones are forgotten once polled)")
      end
      chosen[#chosen + 1] = id
    end
  else
    for id in pairs(self.requests) do
      chosen[#chosen + 1] = id
    end
    table.sort(chosen)
  end
  local out = {}
  for _, id in ipairs(chosen) do
    local request = self.requests[id]
    out[#out + 1] = view(request, request.polled)
    request.polled = #request.tokens
    if request.done then
      self.requests[id] = nil
    end
  end
  return out
end

--- Generates every prompt to `max_tokens` and waits until all are done
--- (inside a coroutine): [{token_ids, logprobs, spans, model_version}].
---@param prompts integer[][]
---@param max_tokens integer
---@return table[]
function Decoder:generate(prompts, max_tokens)
  local requests = {}
  for index, prompt in ipairs(prompts) do
    requests[index] = { prompt = prompt, max_tokens = max_tokens }
  end
  local ids = self:submit(requests)
  self.done:wait(function()
    for _, id in ipairs(ids) do
      if not self.requests[id].done then
        return false
      end
    end
    return true
  end)
  local outputs = {}
  for index, id in ipairs(ids) do
    local request = self.requests[id]
    self.requests[id] = nil
    outputs[index] = { token_ids = request.tokens, logprobs = request.logprobs, spans = request.spans,
      model_version = request.model_version, finish = request.finish }
  end
  return outputs
end

--- Requests in flight (submitted, not finished).
function Decoder:in_flight()
  return #self.active
end

--- The pause modes, as vLLM names them: "abort" ends the requests in flight
--- (finish = "aborted"), "wait" lets them finish before the pause completes,
--- "keep" holds them until resume. The KV policies of keep: "recompute"
--- (the default) or "keep" the cache computed under the old weights.
M.PAUSE_MODES = { abort = true, wait = true, keep = true }
M.KV_POLICIES = { recompute = "recomputed", keep = "kept" }

--- Pauses generation (inside a coroutine: "wait" waits for the requests in
--- flight). Returns {mode, aborted, finished, held}.
---@param mode string
---@param kv string?
function Decoder:pause(mode, kv)
  if not M.PAUSE_MODES[mode] then
    errors.raise("INVALID_ARGUMENT", string.format("pause mode must be abort, wait or keep, got %s", tostring(mode)))
  end
  if kv ~= nil and not M.KV_POLICIES[kv] then
    errors.raise("INVALID_ARGUMENT", string.format("the KV policy of keep must be recompute or keep, got %s",
      tostring(kv)))
  end
  if self.paused then
    errors.raise("STATE_REFUSED", string.format("generation is paused already (%s)", self.paused.mode))
  end
  local aborted, waited = 0, #self.active
  if mode == "abort" then
    for _, id in ipairs(self.active) do
      local request = self.requests[id]
      request.done, request.finish = true, "aborted"
    end
    aborted, self.active = #self.active, {}
    self:_stop()
    self.done:notify()
  elseif mode == "wait" then
    self.done:wait(function()
      return #self.active == 0
    end)
  end
  self.paused = { mode = mode, kv = kv or "recompute", version = self.version() }
  return { mode = mode, aborted = aborted, finished = mode == "wait" and waited or 0, held = #self.active }
end

--- Resumes generation; requests held by a keep-mode pause go on, and when a
--- new version was committed meanwhile their next span says what became of
--- their KV cache. Returns {held, kv}.
function Decoder:resume()
  local paused = self.paused
  if not paused then
    errors.raise("STATE_REFUSED", "resume without a pause")
  end
  self.paused = nil
  if self.version() ~= paused.version then
    for _, id in ipairs(self.active) do
      self.requests[id].resumed_kv = M.KV_POLICIES[paused.kv]
    end
  end
  self:_start()
  return { held = #self.active, kv = #self.active > 0 and M.KV_POLICIES[paused.kv] or nil }
end

--- Whether generation is paused (and how).
function Decoder:pause_state()
  return self.paused
end

--- Stops generating; requests in flight end unfinished.
function Decoder:close()
  self:_stop()
  self.active = {}
end

return M
