--- Fault injection for tests: makes a runtime process misbehave on purpose at
--- a chosen command, so that the host's fail-stop handling can be proved.
---
--- Spec (the WSYNC_RUNTIME_FAULT environment variable of a runtime process, or
--- the `fault` option of runtime.spawn): comma-separated items
--- `[worker<R>:]KIND@CMD[#N]`: do KIND at the N-th (default first) request
--- CMD; items prefixed `worker<R>:` are handed to TP worker R instead.
---
--- KINDs: crash (die by SIGKILL), hang (never answer), stop (SIGSTOP itself:
--- a process that stops answering and that only SIGKILL ends), stubborn
--- (never answer and ignore SIGTERM), eof (close the channel), wrong_id, wrong_cmd,
--- wrong_protocol, bad_result (a non-object result), garbage (an undecodable
--- frame), oversize (a frame longer than the limit), error (answer ok=false).
local M = {}

M.KINDS = {
  crash = true, hang = true, stop = true, stubborn = true, eof = true, wrong_id = true, wrong_cmd = true,
  wrong_protocol = true, bad_result = true, garbage = true, oversize = true, error = true,
}

--- Parses a spec. Returns `{own = {{kind, cmd, nth}...}, workers = {[rank] =
--- "spec for that worker"}}`, or raises naming the bad item.
---@param spec string?
function M.parse(spec)
  local parsed = { own = {}, workers = {} }
  if spec == nil or spec == "" then
    return parsed
  end
  for item in spec:gmatch("[^,]+") do
    local rank, rest = item:match("^worker(%d+):(.+)$")
    local kind, cmd, nth = (rest or item):match("^([%w_]+)@([%w_]+)#?(%d*)$")
    if not kind or not M.KINDS[kind] then
      error(string.format("bad fault spec item '%s' (want [worker<R>:]KIND@CMD[#N])", item), 2)
    end
    if rank then
      local key = tonumber(rank)
      parsed.workers[key] = parsed.workers[key] and (parsed.workers[key] .. "," .. rest) or rest
    else
      parsed.own[#parsed.own + 1] = { kind = kind, cmd = cmd, nth = tonumber(nth) or 1, seen = 0 }
    end
  end
  return parsed
end

--- Returns the fault kind to perform for this request of `cmd`, or nil.
---@param parsed table
---@param cmd string
---@return string?
function M.take(parsed, cmd)
  local kind = nil
  -- Every item of `cmd` counts this request, also after one has fired, so
  -- that `#N` always means the N-th request of the command.
  for _, fault in ipairs(parsed.own) do
    if fault.cmd == cmd then
      fault.seen = fault.seen + 1
      if fault.seen == fault.nth and kind == nil then
        kind = fault.kind
      end
    end
  end
  return kind
end

return M
