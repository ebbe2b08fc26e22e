--- The fuzz entry: what the libFuzzer target (tests/fuzz/fuzz_wsync.c) runs on
--- every input inside a wsync host, and what
--- tests/unit/scripts/control/fuzz_regressions_spec.lua replays, without the
--- fuzzer, over tests/fuzz/regressions/ and tests/fuzz/corpus/.
---
--- The first byte of an input picks the mode (its value modulo #M.MODES) and,
--- for the modes that take a stream, whether the stream is raw bytes (even
--- quotient) or framed lines (odd): every non-empty line becomes one frame
--- body, prefixed with its length by the entry, so that the fuzzer's
--- mutations of the JSON keep the frames whole. The peer and server modes
--- take one more byte (their choices) before the stream.
---   frames      bytes for wsync.control.protocol's streaming decoder, pushed
---               whole and split at pseudo-random points (the results must
---               agree); every message decoded goes through the checks a
---               receiving end runs: check_request, check_response and
---               wsync.control.messages.check of its payload and its result
---               against its cmd in every schema table (what passes must
---               check again unchanged).
---   host_peer   a real wsync.control.peer on the host's side of a socket pair
---   agent_peer  (schemas to_host/from_agent), or on the agent's side
---               (to_agent/from_host), with handlers that answer; the bytes
---               arrive from the other end in pseudo-random pieces, then EOF.
---               The choice byte c picks the request the peer sends first
---               (the (c % (n + 1))-th of the n result commands, sorted; 0:
---               none) and whether the handlers answer, fail with a coded
---               error or raise a plain one (c // 32 % 3).
---   server      the same against wsync.control.server, the serving end of
---               every process the host spawns.
---   recipe      recipe text for wsync.recipe.load, from a file in a temporary
---               directory that also holds recipes/ and tests/fixtures/recipes/
---               (so that the committed recipes' `extends` paths resolve);
---               a recipe that loads then goes through wsync.recipe.check
---               with plan_only, as `wsync check --plan-only` does.
---
--- `run(input)` returns when wsync handled the input as it must: decoded it,
--- refused it with a coded error, or closed the connection with a reason.
--- Anything else raises an error starting "wsync fuzz finding:": a Lua error
--- that is not a wsync error object with a code, an error out of the loop's
--- callbacks, a decoder whose result depends on how the bytes were split, a
--- peer that read the whole stream without a violation but left a request
--- unanswered, a peer or server that did not close within M.WATCHDOG_MS, or an
--- instruction budget that ran out in wsync's own code. A recipe that runs
--- past its budget in its own code (`while true do end` is a recipe) is an
--- expected rejection: the budget bounds every recipe.
local uv = require("luv")
local bit = require("bit")
local errors = require("wsync.errors")
local loop = require("wsync.loop")
local messages = require("wsync.control.messages")
local peer_module = require("wsync.control.peer")
local protocol = require("wsync.control.protocol")
local recipe_module = require("wsync.recipe")
local server_module = require("wsync.control.server")

local M = {}

local real_require = require

--- The modes, in the order the first byte picks them.
M.MODES = { "frames", "host_peer", "agent_peer", "server", "recipe" }

--- Instructions a recipe's load may run (the committed recipes take under
--- 10,000), and the frames mode's checks of one input.
M.RECIPE_BUDGET = 1000000
M.FRAMES_BUDGET = 20000000
--- Instructions the plan and schedule check of a loaded recipe may run (the
--- demo's takes 15,000, the 30B-A3B recipe's 5 million: over it).
M.CHECK_BUDGET = 1000000

--- How long a peer or server may take to close after the last byte, in ms.
M.WATCHDOG_MS = 5000

--- The schema tables of wsync.control.messages, by name.
M.SCHEMA_TABLES = { "to_host", "from_agent", "to_agent", "from_host", "from_runtime" }

local BUDGET_MESSAGE = "wsync fuzz: instruction budget exhausted"
local BUDGET_STEP = 1000
local ENTRY_SUFFIX = "tests/fuzz/entry.lua"

local function finding(format, ...)
  error("wsync fuzz finding: " .. string.format(format, ...), 0)
end

local function pack(...)
  return { n = select("#", ...), ... }
end

local function sorted_keys(map)
  local keys = {}
  for key in pairs(map) do
    keys[#keys + 1] = key
  end
  table.sort(keys)
  return keys
end

-- Instruction budget -----------------------------------------------------------

local function is_entry(source)
  return source:sub(-#ENTRY_SUFFIX) == ENTRY_SUFFIX
end

-- The budget without the fuzz target: a count hook of this state (the target
-- has one hook for coverage and the budget, and replaces this with
-- M.set_budget). `arm(n)` arms, `arm(0)` disarms and says whether it ran out.
-- Once out, every instruction outside this file raises, so that a pcall in the
-- loop that ran out cannot catch the error and go on.
local lua_budget
do
  local exhausted = nil
  local left = 0
  local function hook()
    if not exhausted then
      left = left - BUDGET_STEP
      if left > 0 then
        return
      end
      local lines = { BUDGET_MESSAGE }
      for level = 2, 200 do
        local info = debug.getinfo(level, "Sl")
        if not info then
          break
        end
        if info.currentline >= 0 then
          lines[#lines + 1] = info.source .. ":" .. info.currentline
        end
      end
      exhausted = table.concat(lines, "\n")
      debug.sethook(hook, "", 1)
    end
    if is_entry(debug.getinfo(2, "S").source) then
      return
    end
    error(exhausted, 0)
  end
  function lua_budget(instructions)
    local was = exhausted ~= nil
    exhausted = nil
    if instructions > 0 then
      left = instructions
      debug.sethook(hook, "", BUDGET_STEP)
    else
      debug.sethook()
    end
    return was
  end
end

local arm_budget = lua_budget

--- Replaces the instruction budget (the fuzz target's hook does it in C):
--- `arm(instructions)` arms it, `arm(0)` disarms it and returns whether it
--- ran out. An exhausted budget raises a string starting with
--- "wsync fuzz: instruction budget exhausted", then one "source:line" per
--- Lua frame, innermost first.
---@param arm fun(instructions: number): boolean
function M.set_budget(arm)
  arm_budget = arm
end

-- Calls fn(...) in protected mode within `instructions`, with the JIT off
-- (compiled traces call no hooks). Returns pcall's results.
local function with_budget(instructions, fn, ...)
  local jit_on = jit.status()
  jit.off()
  arm_budget(instructions)
  local results = pack(pcall(fn, ...))
  arm_budget(0)
  if jit_on then
    jit.on()
  end
  return unpack(results, 1, results.n)
end

local function is_budget_error(err)
  return type(err) == "string" and err:sub(1, #BUDGET_MESSAGE) == BUDGET_MESSAGE
end

-- Fails unless `err` is a wsync error object with a code that reads as text
-- (what every receiving end does with an error: it reports it).
local function expect_coded(err, what)
  if is_budget_error(err) then
    finding("%s ran out of its instruction budget in wsync's code:\n%s", what, err)
  end
  if not errors.is(err) or type(err.code) ~= "string" then
    finding("%s raised an error that is not a coded wsync error: %s", what, tostring(err))
  end
  local ok, text = pcall(errors.format, err, true)
  if not ok or type(text) ~= "string" then
    finding("%s raised a %s error that cannot be reported: %s", what, err.code, tostring(text))
  end
end

-- Pseudo-random pieces ---------------------------------------------------------

-- A generator of piece sizes in [0, 16], seeded by the bytes (every run of an
-- input splits it at the same points).
local function piece_sizes(bytes)
  local state = 2166136261
  for i = 1, #bytes do
    state = bit.bxor(state, bytes:byte(i))
    state = bit.tobit(state * 16777619)
  end
  return function()
    state = bit.tobit(state * 1103515245 + 12345)
    return bit.band(bit.rshift(state, 16), 31) % 17
  end
end

local function pieces(bytes)
  local next_size, list, position = piece_sizes(bytes), {}, 1
  while position <= #bytes do
    local size = next_size()
    list[#list + 1] = bytes:sub(position, position + size - 1)
    position = position + size
  end
  return list
end

-- Frames -------------------------------------------------------------------------

-- Deep equality that holds NaN equal to NaN (a body may say NaN).
local function same(a, b)
  if a == b or (a ~= a and b ~= b) then
    return true
  end
  if type(a) ~= "table" or type(b) ~= "table" then
    return false
  end
  for key, value in pairs(a) do
    if not same(value, b[key]) then
      return false
    end
  end
  for key in pairs(b) do
    if a[key] == nil then
      return false
    end
  end
  return true
end

-- Pushes `list` into a fresh decoder. Returns every message delivered, in
-- order, and the failure reason (nil when the stream was good).
local function decode(list, limit)
  local decoder = protocol.decoder(limit)
  local delivered = {}
  local function take(batch)
    if type(batch) ~= "table" then
      finding("decoder push returned a %s for its messages", type(batch))
    end
    for _, message in ipairs(batch) do
      delivered[#delivered + 1] = message
    end
  end
  list[#list + 1] = "" -- a push with nothing new delivers nothing new
  for _, piece in ipairs(list) do
    local batch, reason, before = decoder:push(piece)
    if not batch then
      if type(reason) ~= "string" then
        finding("decoder failed without a reason")
      end
      take(before or {})
      local again, reason_again = decoder:push("{}")
      if again ~= nil or reason_again ~= reason then
        finding("a failed decoder took more bytes (%s, then %s)", reason, tostring(reason_again))
      end
      return delivered, reason
    end
    take(batch)
  end
  return delivered, nil
end

-- What a receiving end checks of one message, with every schema.
local function check_message(message)
  local ok, reason, code = protocol.check_request(message)
  if ok ~= true and (ok ~= nil or type(reason) ~= "string" or type(code) ~= "string") then
    finding("check_request returned %s, %s, %s", tostring(ok), tostring(reason), tostring(code))
  end
  local cmd = type(message.cmd) == "string" and message.cmd or "info"
  for _, id in ipairs({ 1, type(message.id) == "number" and message.id or 2 }) do
    local answered, why = protocol.check_response(message, id, cmd)
    if answered ~= true and (answered ~= nil or type(why) ~= "string") then
      finding("check_response returned %s, %s", tostring(answered), tostring(why))
    end
  end
  for _, table_name in ipairs(M.SCHEMA_TABLES) do
    local schemas = messages[table_name]
    for _, value in ipairs({ message.payload or {}, message.result or {} }) do
      local checked, bad = messages.check(schemas, cmd, value)
      if checked == nil then
        if type(bad) ~= "string" then
          finding("messages.check(%s, %s) refused without a reason", table_name, cmd)
        end
      else
        local again, bad_again = messages.check(schemas, cmd, checked)
        if again == nil or not same(checked, again) then
          finding("messages.check(%s, %s) passed a value that does not check again: %s", table_name, cmd,
            tostring(bad_again))
        end
      end
    end
  end
end

local function run_frames(stream)
  local whole, whole_failure = decode({ stream })
  local split, split_failure = decode(pieces(stream))
  if whole_failure ~= split_failure or not same(whole, split) then
    finding("the decoder's result depends on the split: %d messages, %s whole; %d messages, %s split", #whole,
      tostring(whole_failure), #split, tostring(split_failure))
  end
  decode(pieces(stream), 64) -- a small limit: oversize frames
  for _, message in ipairs(whole) do
    check_message(message)
  end
end

-- Peers and servers ------------------------------------------------------------

-- Handlers that answer every command of `commands`: with a result, with a
-- coded error, or by raising a plain Lua error (`kind` 0, 1, 2).
local function handlers(commands, kind)
  local result = {}
  for _, cmd in ipairs(commands) do
    result[cmd] = function(payload)
      if kind == 1 then
        errors.raise("FUZZ_REFUSED", "the fuzz handler refuses " .. cmd, { phase = cmd })
      elseif kind == 2 then
        error("the fuzz handler fails " .. cmd)
      end
      return { handled = cmd, fields = #sorted_keys(payload) }
    end
  end
  return result
end

local function socket_pair()
  local fds = assert(uv.socketpair(nil, nil, { nonblock = true }, { nonblock = true }))
  local far = uv.new_pipe(false)
  assert(far:open(fds[2]))
  return fds[1], far
end

-- Drives the far end of a connection: writes `stream` in pieces (each after
-- the last one's write completed), then shuts down its side, and reads what
-- the near end sends until EOF. `report.frames` gets every message read,
-- `report.failure` the decoder's failure.
local function drive(far, stream, report)
  local decoder = protocol.decoder()
  report.frames = {}
  far:read_start(function(err, data)
    if err or data == nil then
      far:read_stop()
      if not far:is_closing() then
        far:close()
      end
      return
    end
    local batch, reason, before = decoder:push(data)
    for _, message in ipairs(batch or before or {}) do
      report.frames[#report.frames + 1] = message
    end
    report.failure = report.failure or reason
  end)
  local list, index = pieces(stream), 0
  local function write_next()
    if far:is_closing() then
      return
    end
    index = index + 1
    if index > #list then
      far:shutdown()
      return
    end
    local ok = far:write(list[index], function(err)
      if err then
        return -- the near end closed: it read what it wanted
      end
      write_next()
    end)
    if not ok then
      return
    end
  end
  write_next()
end

-- Closes both ends when the connection is still open after M.WATCHDOG_MS
-- (the timer alone does not keep the loop running). Returns a function that
-- disarms it and says whether it fired.
local function watchdog(close_near, far)
  local fired = false
  -- (loop.after times it from now, not from the loop's cached clock, which
  -- stands still while inputs run outside the loop: a recipe's check.)
  local timer = loop.after(M.WATCHDOG_MS, function()
    fired = true
    close_near()
    if not far:is_closing() then
      far:close()
    end
  end)
  timer:unref()
  return function()
    loop.cancel(timer)
    uv.run("nowait") -- completes the close
    return fired
  end
end

-- Runs the loop; any error out of it is a finding (nothing may raise out of a
-- callback of the peer or the server).
local function run_loop(what)
  local ok, err = pcall(loop.run)
  if not ok then
    finding("%s: an error came out of the loop: %s", what, errors.format(err, true))
  end
end

-- Requests in `stream` (decoded whole; for a server every message is one)
-- and whether it ended in a bad frame.
local function requests_in(stream, all)
  local list, failure = decode({ stream })
  local requests = {}
  for _, message in ipairs(list) do
    if all or message.ok == nil then
      requests[#requests + 1] = message
    end
  end
  return requests, failure
end

-- Checks what the near end sent: frames that decode, and responses that have
-- a numeric id, a string cmd and the shape check_response wants. Returns the
-- responses.
local function responses_from(report, what, skip)
  if report.failure then
    finding("%s sent bytes that are no frame: %s", what, report.failure)
  end
  local responses = {}
  for index = skip + 1, #report.frames do
    local message = report.frames[index]
    if type(message.id) ~= "number" or type(message.cmd) ~= "string" then
      finding("%s sent a message without a numeric id and a string cmd", what)
    end
    local ok, reason = protocol.check_response(message, message.id, message.cmd)
    if not ok then
      finding("%s sent a malformed response: %s", what, reason)
    end
    responses[#responses + 1] = message
  end
  return responses
end

-- A stream read whole without a violation leaves no request unanswered.
local function expect_answers(what, stream, responses)
  local requests, failure = requests_in(stream, what == "server")
  if failure then
    return
  end
  if #responses ~= #requests then
    finding("%s read the whole stream and closed cleanly, but answered %d of its %d requests", what, #responses,
      #requests)
  end
end

local PEER_SIDES = {
  host_peer = { requests = "to_host", results = "from_agent" },
  agent_peer = { requests = "to_agent", results = "from_host" },
}

local function run_peer(mode, choice, stream)
  local side = PEER_SIDES[mode]
  local request_schemas, result_schemas = messages[side.requests], messages[side.results]
  local outgoing = sorted_keys(result_schemas)
  local first_cmd = outgoing[choice % (#outgoing + 1)] -- nil: send none
  local near_fd, far = socket_pair()
  local near = uv.new_pipe(false)
  assert(near:open(near_fd))
  local closed, violation, request_outcome = nil, nil, nil
  local peer = peer_module.new(near, {
    name = "fuzzed " .. mode,
    handlers = handlers(sorted_keys(request_schemas), math.floor(choice / 32) % 3),
    schemas = { requests = request_schemas, results = result_schemas },
    on_close = function(reason, was_violation)
      closed, violation = reason, was_violation
    end,
    on_bad_request = function() end,
  })
  local report = {}
  local disarm = watchdog(function()
    peer:close("the fuzz watchdog fired")
  end, far)
  if first_cmd then
    loop.spawn(function()
      local ok, err = pcall(peer.request, peer, first_cmd, {}, 60)
      request_outcome = ok and "answered" or err
    end)
  end
  drive(far, stream, report)
  run_loop(mode)
  if disarm() then
    finding("%s did not close within %d ms of the stream's end", mode, M.WATCHDOG_MS)
  end
  if type(closed) ~= "string" then
    finding("%s ended without closing its connection with a reason", mode)
  end
  if first_cmd then
    if request_outcome == nil then
      finding("%s: the request %s never returned", mode, first_cmd)
    elseif request_outcome ~= "answered" then
      expect_coded(request_outcome, mode .. "'s request " .. first_cmd)
    end
  end
  local responses = responses_from(report, mode, first_cmd and 1 or 0)
  if not violation then
    expect_answers(mode, stream, responses)
  end
end

local function run_server(choice, stream)
  local near_fd, far = socket_pair()
  local closed = nil
  local server
  local spin = server_module.SPIN_MICROSECONDS
  server_module.SPIN_MICROSECONDS = 0
  local ok, err = pcall(function()
    server = server_module.serve({
      fd = near_fd,
      name = "fuzzed server",
      handlers = handlers({ "info", "sleep", "wake", "load_chunk", "finish_update", "shutdown" },
        math.floor(choice / 32) % 3),
      on_close = function(reason)
        closed = reason
        server:close()
      end,
    })
  end)
  if not ok then
    server_module.SPIN_MICROSECONDS = spin
    error(err, 0)
  end
  local report = {}
  local disarm = watchdog(function()
    server:close()
  end, far)
  drive(far, stream, report)
  local loop_ok, loop_error = pcall(run_loop, "server")
  server_module.SPIN_MICROSECONDS = spin
  if not loop_ok then
    error(loop_error, 0)
  end
  if disarm() then
    finding("server did not close within %d ms of the stream's end", M.WATCHDOG_MS)
  end
  local responses = responses_from(report, "server", 0)
  if closed == "EOF" then
    expect_answers("server", stream, responses)
  end
end

-- Recipes ------------------------------------------------------------------------

-- What a fuzzed recipe may require: wsync's namespace, and the modules the
-- loader itself requires while it validates. The recipe environment is no
-- sandbox (a recipe is the user's own code): calling wsync's API with fuzzed
-- arguments is not the loader's surface, so the rest is refused.
local RECIPE_MODULES = { ["wsync"] = true, ["wsync.native.device"] = true }

local function recipe_require(name)
  if RECIPE_MODULES[name] then
    return real_require(name)
  end
  errors.raise("FUZZ_REQUIRE", string.format("the fuzz entry gives recipes no module '%s'", tostring(name)))
end

local recipe_directory = nil

local function repository_root()
  local source = debug.getinfo(1, "S").source:sub(2)
  local absolute = assert(uv.fs_realpath(source))
  return (absolute:gsub("/tests/fuzz/entry%.lua$", ""))
end

-- The temporary directory of fuzzed recipes (made on first use): the recipe
-- lives in tests/fixtures/recipes/ beside links to the committed fixtures, and
-- recipes/ links to the committed recipes.
local function recipe_path()
  if not recipe_directory then
    local root = repository_root()
    local base = os.getenv("TMPDIR") or "/tmp"
    recipe_directory = assert(uv.fs_mkdtemp(base .. "/wsync-fuzz-XXXXXX"))
    assert(uv.fs_symlink(root .. "/recipes", recipe_directory .. "/recipes"))
    assert(uv.fs_mkdir(recipe_directory .. "/tests", 448))
    assert(uv.fs_mkdir(recipe_directory .. "/tests/fixtures", 448))
    local fixtures = recipe_directory .. "/tests/fixtures/recipes"
    assert(uv.fs_mkdir(fixtures, 448))
    local scanner = uv.fs_scandir(root .. "/tests/fixtures/recipes")
    while scanner do
      local name = uv.fs_scandir_next(scanner)
      if not name then
        break
      end
      assert(uv.fs_symlink(root .. "/tests/fixtures/recipes/" .. name, fixtures .. "/" .. name))
    end
  end
  return recipe_directory .. "/tests/fixtures/recipes/recipe.lua"
end

--- Removes the temporary directory of fuzzed recipes (the spec calls it when
--- done; the fuzz target at exit).
function M.cleanup()
  if not recipe_directory then
    return
  end
  local function remove(path)
    local stat = uv.fs_lstat(path)
    if stat and stat.type == "directory" then
      local scanner = uv.fs_scandir(path)
      while scanner do
        local name = uv.fs_scandir_next(scanner)
        if not name then
          break
        end
        remove(path .. "/" .. name)
      end
      uv.fs_rmdir(path)
    elseif stat then
      uv.fs_unlink(path)
    end
  end
  remove(recipe_directory)
  recipe_directory = nil
end

local function run_recipe(text)
  local path = recipe_path()
  local file = assert(io.open(path, "wb"))
  file:write(text)
  file:close()
  for name in pairs(RECIPE_MODULES) do
    real_require(name) -- loaded with their own requires, before these are refused
  end
  local saved_print, saved_require = _G.print, _G.require
  _G.print, _G.require = function() end, recipe_require
  local ok, loaded = with_budget(M.RECIPE_BUDGET, recipe_module.load, path)
  _G.print, _G.require = saved_print, saved_require
  if not ok then
    if is_budget_error(loaded) and loaded:find("\n@" .. path .. ":", 1, true) then
      return -- the recipe's own code ran long: a recipe may
    end
    return expect_coded(loaded, "wsync.recipe.load")
  end
  -- What `wsync check --plan-only` does next: the plan and the schedule.
  -- (A plan too large to build within the budget is no finding: the budget
  -- is small for a fuzzer's sake.)
  local checked, err = with_budget(M.CHECK_BUDGET, recipe_module.check, loaded, { plan_only = true })
  if not checked and not is_budget_error(err) then
    expect_coded(err, "wsync.recipe.check")
  end
end

--- The mode an input's first byte picks, and whether its stream is framed
--- lines (see the module's comment).
---@param byte integer
---@return string mode, boolean framed
function M.mode(byte)
  return M.MODES[byte % #M.MODES + 1], math.floor(byte / #M.MODES) % 2 == 1
end

--- The byte of `mode` (framed lines or not).
---@param mode string
---@param framed boolean?
---@return string
function M.mode_byte(mode, framed)
  for index, name in ipairs(M.MODES) do
    if name == mode then
      return string.char(index - 1 + (framed and #M.MODES or 0))
    end
  end
  error("no fuzz mode " .. tostring(mode), 2)
end

local function length_prefixed(body)
  local length = #body
  return string.char(math.floor(length / 16777216) % 256, math.floor(length / 65536) % 256,
    math.floor(length / 256) % 256, length % 256) .. body
end

--- Each non-empty line of `text` as a frame: its length, then the line.
---@param text string
---@return string
function M.frame_lines(text)
  local frames = {}
  for body in text:gmatch("[^\n]+") do
    frames[#frames + 1] = length_prefixed(body)
  end
  return table.concat(frames)
end

-- Structure-aware mutation ------------------------------------------------------

local mutation_json = require("cjson").new()
mutation_json.encode_invalid_numbers(true)
mutation_json.encode_sparse_array(true)
mutation_json.decode_max_depth(64)
mutation_json.encode_max_depth(64)

-- A generator of integers in [1, n], seeded by libFuzzer's seed.
local function random_from(seed)
  local state = bit.tobit(seed)
  return function(n)
    state = bit.tobit(state * 1103515245 + 12345)
    return bit.band(bit.rshift(state, 8), 0x7fffff) % n + 1
  end
end

-- The words the schemas and the protocol know (commands and fields), for
-- keys and string values.
local known_words = nil
local function words()
  if known_words then
    return known_words
  end
  local seen = {}
  local function walk(spec, depth)
    if type(spec) ~= "table" or depth > 6 then
      return
    end
    for key, value in pairs(spec.fields or {}) do
      seen[key] = true
      walk(value, depth + 1)
    end
    walk(spec.item, depth + 1)
  end
  for _, table_name in ipairs(M.SCHEMA_TABLES) do
    for cmd, spec in pairs(messages[table_name]) do
      seen[cmd] = true
      walk(spec, 0)
    end
  end
  for _, word in ipairs({ "protocol", "id", "cmd", "payload", "ok", "result", "error", "code", "message", "fatal",
    "traceback", "phase", "rank", "file", "line", "field" }) do
    seen[word] = true
  end
  known_words = sorted_keys(seen)
  return known_words
end

-- JSON values that find the edges of a schema.
local function interesting(random)
  local values = {
    0, -1, 1, 2, 8, 9, 1.5, -0.5, 2 ^ 31, 2 ^ 32, 2 ^ 53, 2 ^ 53 + 2, 2 ^ 63, -2 ^ 63, 1e308, 1 / 0, -1 / 0, 0 / 0,
    "", "x", string.rep("a", 300), "\0", "wsync-1-0-0", string.rep("0f", 16), string.rep("0123456789abcdef", 4),
    true, false, mutation_json.null, {}, { 1 }, { "x" }, { {} }, { a = 1 },
  }
  local choice = random(#values + 2)
  if choice > #values then
    local list = words()
    return list[random(#list)]
  end
  return values[choice]
end

-- Every table and key of `value` (depth-first) as {parent, key} pairs.
local function slots(value, list, depth)
  if type(value) == "table" and depth < 32 then
    for key, item in pairs(value) do
      list[#list + 1] = { value, key }
      slots(item, list, depth + 1)
    end
  end
  return list
end

local function mutate_message(message, random)
  local list = slots(message, {}, 0)
  local action = random(5)
  if action == 1 or #list == 0 then
    -- A field the schemas know, at the top or inside a table.
    local tables = { message }
    for _, slot in ipairs(list) do
      if type(slot[1][slot[2]]) == "table" then
        tables[#tables + 1] = slot[1][slot[2]]
      end
    end
    local names = words()
    tables[random(#tables)][names[random(#names)]] = interesting(random)
    return
  end
  local slot = list[random(#list)]
  if action == 2 then
    slot[1][slot[2]] = nil
  elseif action == 3 then
    local other = list[random(#list)]
    slot[1][slot[2]] = other[1][other[2]] -- a value from elsewhere
  else
    slot[1][slot[2]] = interesting(random)
  end
end

-- Lua values that find the edges of a recipe's schema (as source text).
local LUA_VALUES = {
  "0", "-1", "1", "1.5", "2^53", "2^53 + 2", "2^63", "1/0", "-1/0", "0/0", "1e308", "nil", "true", "false", '""',
  '"x"', '"host"', '"cuda"', '"tiny"', "{}", "{ 1 }", "{ {} }", "{ x = 1 }", "function() end", "string.rep('a', 300)",
}

-- Replaces one value written in the recipe (after a `=`, or a string
-- literal; not in a comment) by an edge value.
local function mutate_recipe(text, random)
  local positions = {}
  local offset = 0
  for line in text:gmatch("[^\n]*\n?") do
    if line == "" then
      break
    end
    local code = line:gsub("%-%-.*$", "")
    for start, finish in code:gmatch("=%s*()[^,}=\n][^,}\n]*()") do
      positions[#positions + 1] = { offset + start, offset + finish }
    end
    for start, finish in code:gmatch('()"[^"]*"()') do
      positions[#positions + 1] = { offset + start, offset + finish }
    end
    offset = offset + #line
  end
  if #positions == 0 then
    return nil
  end
  local where = positions[random(#positions)]
  return text:sub(1, where[1] - 1) .. LUA_VALUES[random(#LUA_VALUES)] .. text:sub(where[2])
end

--- Mutates an input the way its mode reads it, for the fuzz target's custom
--- mutator: one value of one message (a field the schemas know added, a
--- field removed, a value replaced by an edge value or by a value from
--- elsewhere, a message repeated or dropped), re-encoded with correct
--- lengths; for a recipe, one literal replaced by an edge value. Returns the
--- new input, or nil when the input has no structure to mutate (libFuzzer's
--- own mutations take over).
---@param input string
---@param seed integer
---@return string?
function M.mutate(input, seed)
  if #input == 0 then
    return nil
  end
  local random = random_from(seed)
  local mode, framed = M.mode(input:byte(1))
  if mode == "recipe" then
    local text = mutate_recipe(input:sub(2), random)
    return text and (input:sub(1, 1) .. text)
  end
  local head_size = mode == "frames" and 1 or 2
  local stream = input:sub(head_size + 1)
  local bodies = {}
  if framed then
    for body in stream:gmatch("[^\n]+") do
      bodies[#bodies + 1] = body
    end
  else
    local position = 1
    while position + 3 <= #stream do
      local b1, b2, b3, b4 = stream:byte(position, position + 3)
      local length = ((b1 * 256 + b2) * 256 + b3) * 256 + b4
      bodies[#bodies + 1] = stream:sub(position + 4, position + 3 + length)
      position = position + 4 + length
    end
  end
  local parsed = {}
  for index, body in ipairs(bodies) do
    local ok, message = pcall(mutation_json.decode, body)
    if ok and type(message) == "table" then
      parsed[#parsed + 1] = index
      bodies[index] = message
    end
  end
  if #parsed == 0 then
    return nil
  end
  local index = parsed[random(#parsed)]
  local action = random(8)
  if action == 1 then
    table.insert(bodies, random(#bodies + 1), bodies[index])
  elseif action == 2 and #bodies > 1 then
    table.remove(bodies, index)
  else
    -- (A repeated message is the same table: decode a fresh copy.)
    local ok, copy = pcall(mutation_json.decode, mutation_json.encode(bodies[index]))
    if not ok then
      return nil
    end
    mutate_message(copy, random)
    bodies[index] = copy
  end
  local out = { input:sub(1, head_size) }
  for _, body in ipairs(bodies) do
    if type(body) == "table" then
      local ok, text = pcall(mutation_json.encode, body)
      if not ok then
        return nil
      end
      body = text
    end
    out[#out + 1] = framed and (body .. "\n") or length_prefixed(body)
  end
  return table.concat(out)
end

--- Runs one input (see the module's comment). Returns, or raises a finding.
---@param input string
function M.run(input)
  if #input == 0 then
    return
  end
  local mode, framed = M.mode(input:byte(1))
  if mode == "recipe" then
    return run_recipe(input:sub(2))
  end
  local choice, stream = 0, input:sub(2)
  if mode ~= "frames" then
    choice, stream = input:byte(2) or 0, input:sub(3)
  end
  if framed then
    stream = M.frame_lines(stream)
  end
  if mode == "frames" then
    local ok, err = with_budget(M.FRAMES_BUDGET, run_frames, stream)
    if not ok then
      if is_budget_error(err) then
        finding("the frames checks ran out of their instruction budget:\n%s", err)
      end
      error(err, 0)
    end
  elseif mode == "server" then
    run_server(choice, stream)
  else
    run_peer(mode, choice, stream)
  end
end

return M
