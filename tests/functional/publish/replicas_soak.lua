-- The soak of tests/functional/publish/replicas_spec.lua, run as
-- `wsync replicas_soak.lua RECIPE`: four requests stream, balanced over the
-- replicas (each on one), while the session runs every round of RECIPE
-- (pause, publish, resume), polled every 25 rounds; prints "SOAK <json>":
-- per request, its replica, the tokens seen and generated, the spans and
-- their versions, and every poll that did not start where the one before
-- ended.
local cjson = require("cjson")
local loop = require("wsync.loop")
local recipe = require("wsync.recipe").load(...)
local s = require("wsync.publish.session").open(recipe)
s:wait_publish()
local requests = {}
for i = 1, 4 do
  requests[i] = { prompt = { i, i + 1 }, max_tokens = 60000 }
end
s.rollout:request("submit", { requests = requests })
-- per request id (across the replicas): tokens seen, its replica, its spans
local seen = {}
local problems = {}
local function poll()
  local answer = s.rollout:request("poll", {})
  for _, request in ipairs(answer.requests) do
    local got = seen[request.id] or { tokens = 0, replica = request.replica }
    if request.first_token ~= got.tokens then
      problems[#problems + 1] = string.format("request %d: poll starts at %d, %d seen", request.id,
        request.first_token, got.tokens)
    end
    if request.replica ~= got.replica then
      problems[#problems + 1] = string.format("request %d moved from replica %s to %s", request.id,
        tostring(got.replica), tostring(request.replica))
    end
    got.tokens = got.tokens + #request.tokens
    got.generated = request.generated
    got.spans = request.spans
    seen[request.id] = got
  end
end
local rounds = 0
for round = 1, recipe.trainer.steps do
  s:wait_publish()
  local report, failure = s:round()
  if not report then
    problems[#problems + 1] = "round " .. round .. " failed: " .. tostring(failure)
    break
  end
  rounds = round
  loop.sleep(3) -- (generation runs between publications)
  if round % 25 == 0 then
    poll()
  end
end
poll()
local summary = { rounds = rounds, problems = problems, requests = {} }
for id, got in pairs(seen) do
  local versions, contiguous, last = {}, true, -1
  for _, span in ipairs(got.spans) do
    versions[#versions + 1] = span.version
    contiguous = contiguous and span.first_token == last + 1
    last = span.last_token
  end
  summary.requests[#summary.requests + 1] = { id = id, replica = got.replica, tokens = got.tokens,
    generated = got.generated, spans = #got.spans, first_version = versions[1], last_version = versions[#versions],
    contiguous = contiguous and last + 1 == got.generated }
end
table.sort(summary.requests, function(a, b)
  return a.id < b.id
end)
io.stdout:write("SOAK ", cjson.encode(summary), "\n")
io.stdout:flush()
s:close()
