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

--- The items of a fault spec, comma-separated: `[PREFIX<R>:]KIND@CMD[#N]`
--- (KIND at the N-th request CMD, N absent: nil) or, where the grammar has
--- them, bare FLAG words; `PREFIX<R>:` ("worker", "rank") aims an item at
--- one process. `grammar` is {kinds (a set, or nil for any word), flags (a
--- set), prefix, what, usage}. Returns a list of {kind, cmd, nth, text,
--- target} and {flag, target} items (`text` the item without its prefix,
--- `target` the prefix's number); raises "bad WHAT 'ITEM'USAGE" for any
--- other item. The one parser of wsync's fault specs in Lua (the runtime's
--- here, the synthetic trainer's $WSYNC_TRAINER_FAULT).
---@param spec string?
---@alias wsync.FaultGrammar {kinds: table<string, boolean>?, flags: table<string, boolean>?, prefix: string?,
---  what: string, usage: string?}
---@param grammar wsync.FaultGrammar
---@return table[]
function M.items(spec, grammar)
  local items = {}
  for item in (spec or ""):gmatch("[^,]+") do
    local target, rest = nil, item
    if grammar.prefix then
      local number, tail = item:match("^" .. grammar.prefix .. "(%d+):(.+)$")
      if number then
        target, rest = tonumber(number), tail
      end
    end
    local kind, cmd, nth = rest:match("^([%w_]+)@([%w_]+)#?(%d*)$")
    if kind and (grammar.kinds == nil or grammar.kinds[kind]) then
      items[#items + 1] = { kind = kind, cmd = cmd, nth = tonumber(nth), text = rest, target = target }
    elseif not kind and grammar.flags and grammar.flags[rest] then
      items[#items + 1] = { flag = rest, target = target }
    else
      error(string.format("bad %s '%s'%s", grammar.what, item, grammar.usage or ""), 0)
    end
  end
  return items
end

--- Parses a runtime's spec. Returns `{own = {{kind, cmd, nth}...}, workers =
--- {[rank] = "spec for that worker"}}`, or raises naming the bad item.
---@param spec string?
function M.parse(spec)
  local parsed = { own = {}, workers = {} }
  local items = M.items(spec, { kinds = M.KINDS, prefix = "worker", what = "fault spec item",
    usage = " (want [worker<R>:]KIND@CMD[#N])" })
  for _, item in ipairs(items) do
    if item.target then
      local rank = item.target
      parsed.workers[rank] = parsed.workers[rank] and (parsed.workers[rank] .. "," .. item.text) or item.text
    else
      parsed.own[#parsed.own + 1] = { kind = item.kind, cmd = item.cmd, nth = item.nth or 1, seen = 0 }
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
