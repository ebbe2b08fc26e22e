--- What a publication session prints on stdout, each line "wsync: ...":
--- M.say writes one, M.wait_for says what a wait waits for while it runs,
--- and the rest compose the lines that sum the session up from its facts:
--- the runtime's and the buffers' shape, each publication, what streaming
--- requests produced in a round, and the closing report around the run
--- report's table (wsync.publish.report's text_lines). The session and
--- the modules it is made of print through here; nothing here decides
--- anything.
local loop = require("wsync.loop")
local plan_module = require("wsync.plan")

local M = {}

local format_bytes = plan_module.format_bytes

--- Writes one line, "wsync: " and `format` formatted, to stdout at once.
---@param format string
function M.say(format, ...)
  io.stdout:write("wsync: ", string.format(format, ...), "\n")
  io.stdout:flush()
end

--- Waits on `condition` until `predicate()` holds or `seconds` have passed;
--- returns whether it holds. `what()`, when given, says what it waits for
--- ("trainer ranks to register: 1 of 2 (rank 1 missing)",
--- "(timeouts.registration)"): printed once the wait ran 5 s, then each time
--- its length doubled (wsync.loop.progress).
---@param condition wsync.Condition
---@param seconds number
---@param predicate fun(): boolean
---@param what (fun(): string, string)?
---@return boolean
function M.wait_for(condition, seconds, predicate, what)
  local progress = what and loop.progress(function(waited)
    local waiting_for, deadline = what()
    M.say("waiting for %s: %.0f s so far, deadline %g s %s", waiting_for, waited, seconds, deadline)
  end)
  local held = condition:wait_for(seconds, predicate)
  loop.cancel(progress)
  return held
end

--- "TP2" or "2 x TP1": the runtime's shape, as messages say it.
---@param topology {tp: integer, replicas: integer?}
---@return string
function M.runtime_shape(topology)
  local replicas = topology.replicas or 1
  return replicas > 1 and string.format("%d x TP%d", replicas, topology.tp) or string.format("TP%d", topology.tp)
end

--- The packed buffers a chunk goes through ("buffers 2 x 1.0 MiB"), or the
--- direct path's words.
---@param recipe table
---@param plan wsync.Plan
---@return string
function M.buffers_shape(recipe, plan)
  if recipe.buffers.direct then
    return "direct: no packed buffers, the TP workers read the trainer's storage"
  end
  return string.format("buffers %d x %s", plan.buffer_count, format_bytes(plan.buffer_bytes))
end

--- A committed publication (its report: wsync.Publication:report(), with
--- `verified` when the resident check ran), for "published ...": "model
--- version 2 (step 2): 1.0 MiB in 3 chunks, 12.5 ms (fill ...), 0.08 GB/s;
--- receipts 2/2".
---@param report table
---@return string
function M.publication(report)
  local t = report.timings
  return string.format("model version %d (step %d): %s in %d chunks, %.1f ms (fill %.1f, load %.1f, finish %.1f), "
    .. "%.2f GB/s; receipts %d/%d%s", report.model_version, report.step, format_bytes(report.bytes), report.chunks,
    t.total * 1e3, t.fill * 1e3, t.load * 1e3, t.finish * 1e3, report.gbps, #report.receipts, #report.receipts,
    report.verified and (report.verified.elements and string.format("; resident weights verified on the device (%d "
      .. "slices, %d elements on %d workers)", report.verified.slices, report.verified.elements,
      report.verified.workers) or string.format("; resident weights verified (%d tensors on %d workers)",
      report.verified.tensors, report.verified.workers)) or "")
end

--- The last three of `spans` as "v1 tokens 1-2 (kv recomputed), v2 3-4 ...".
---@param spans table[]?  {version, first_token, last_token, kv}
---@return string
function M.spans(spans)
  local words = {}
  spans = spans or {}
  for index = math.max(1, #spans - 2), #spans do
    local span = spans[index]
    words[#words + 1] = string.format("v%d tokens %d-%d%s", span.version, span.first_token, span.last_token,
      span.kv and (" (kv " .. span.kv .. ")") or "")
  end
  return (#spans > 3 and "..., " or "") .. table.concat(words, ", ")
end

--- After round `round` of a session that streams requests (rollout.stream):
--- what they produced since the last round, from the runtime's answer to
--- `poll` (`requests`, or `replicas` each with its `requests`), and the
--- versions that produced the tokens of the first request that has any (a
--- request may have produced none yet: the first round can end before
--- every request's first token).
---@param round integer
---@param polled table
---@return string
function M.stream(round, polled)
  local tokens, requests, first = 0, 0, nil
  for _, replica in ipairs(polled.replicas or { polled }) do
    for _, request in ipairs(replica.requests or {}) do
      tokens, requests = tokens + #request.tokens, requests + 1
      if not first and #(request.spans or {}) > 0 then
        first = request
      end
    end
  end
  return string.format("round %d: %d streaming requests produced %d tokens since the last round%s", round, requests,
    tokens, first and string.format("; request %d's versions: %s", first.id, M.spans(first.spans))
      or (requests > 0 and "; none has a token yet" or ""))
end

--- The closing report's lines (without "wsync: "): what ran (`about`: the
--- recipe, its plan and topology), the run report's table and times
--- (`report_lines`: wsync.publish.report's text_lines), how the synthetic
--- trainer processes ended (`trainer_ends`: wsync.publish.trainers's ends,
--- nil without them), and the first receipt of the last committed round of
--- `rounds` (the report's rounds kept).
---@param about {recipe: table, plan: wsync.Plan, topology: table}
---@param report_lines string[]
---@param rounds table[]
---@param trainer_ends string?
---@return string[]
function M.closing(about, report_lines, rounds, trainer_ends)
  local recipe, plan, topology = about.recipe, about.plan, about.topology
  local lines = {
    string.format("closing report: recipe %s, %s, %d trainer ranks -> %s %s runtime", recipe.name, plan.family,
      topology.world, M.runtime_shape(topology), recipe.runtime.kind),
    string.format("  plan: %d canonical tensors, %s, %d chunks (%s), manifest %s", #plan.canonical,
      format_bytes(plan.bytes), #plan.chunks, M.buffers_shape(recipe, plan), plan.manifest),
  }
  for _, line in ipairs(report_lines) do
    lines[#lines + 1] = "  " .. line
  end
  if trainer_ends then
    lines[#lines + 1] = "  synthetic trainer processes: " .. trainer_ends
  end
  local last = nil
  for _, round in ipairs(rounds) do
    last = round.committed and round or last
  end
  if last then
    local receipt = last.receipts[1]
    lines[#lines + 1] = string.format("  last receipt (TP rank 0): publication %s, version %d, device %s, %d resident "
      .. "tensors, manifest %s", receipt.publication_id, receipt.model_version, receipt.uuid, receipt.resident_tensors,
      receipt.manifest)
  end
  return lines
end

return M
