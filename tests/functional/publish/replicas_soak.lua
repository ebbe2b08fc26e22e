-- The soak of tests/functional/publish/replicas_spec.lua, run as
-- `wsync replicas_soak.lua RECIPE`: requests stream in every replica while
-- the session runs every round of RECIPE (pause, publish, resume), polled
-- every 25 rounds; prints "SOAK <json>": per replica and request, the tokens
-- seen and generated, the spans and their versions, and every poll that did
-- not start where the one before ended.
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
-- per replica, per request id: tokens seen, the spans' versions
local seen = {}
local problems = {}
local function poll()
  local answer = s.rollout:request("poll", {})
  for r, replica in ipairs(answer.replicas) do
    seen[r] = seen[r] or {}
    for _, request in ipairs(replica.requests) do
      local got = seen[r][request.id] or { tokens = 0 }
      if request.first_token ~= got.tokens then
        problems[#problems + 1] = string.format("replica %d request %d: poll starts at %d, %d seen", r - 1,
          request.id, request.first_token, got.tokens)
      end
      got.tokens = got.tokens + #request.tokens
      got.generated = request.generated
      got.spans = request.spans
      seen[r][request.id] = got
    end
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
local summary = { rounds = rounds, problems = problems, replicas = {} }
for r, requests_seen in pairs(seen) do
  local one = {}
  for id, got in pairs(requests_seen) do
    local versions, contiguous, last = {}, true, -1
    for _, span in ipairs(got.spans) do
      versions[#versions + 1] = span.version
      contiguous = contiguous and span.first_token == last + 1
      last = span.last_token
    end
    one[#one + 1] = { id = id, tokens = got.tokens, generated = got.generated, spans = #got.spans,
      first_version = versions[1], last_version = versions[#versions],
      contiguous = contiguous and last + 1 == got.generated }
  end
  summary.replicas[r] = one
end
io.stdout:write("SOAK ", cjson.encode(summary), "\n")
io.stdout:flush()
s:close()
