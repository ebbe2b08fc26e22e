-- Debugging publications from the REPL: a model recipe stepped phase by phase
-- over a pipe, and a read-only attach to a running host.
local process = require("tests.helpers.process")
local uv = require("luv")

-- Segments in /dev/shm whose creating process is gone, as a set of names.
local function orphan_set()
  local orphans = {}
  local scanner = assert(uv.fs_scandir("/dev/shm"))
  while true do
    local name = uv.fs_scandir_next(scanner)
    if not name then
      break
    end
    local pid = name:match("^wsync%-(%d+)%-")
    if pid and not uv.fs_stat("/proc/" .. pid) then
      orphans[name] = true
    end
  end
  return orphans
end

-- Orphans at the start of each test belong to whatever ran before (a killed
-- run, another test tier): a test's leaks are the orphans it added.
local preexisting = {}
before_each(function()
  preexisting = orphan_set()
end)

-- The orphaned segments that appeared since this test began: leaks.
local function orphan_segments()
  local leaked = {}
  for name in pairs(orphan_set()) do
    if not preexisting[name] then
      leaked[#leaked + 1] = name
    end
  end
  table.sort(leaked)
  return leaked
end

local STEPS = table.concat({
  "s = wsync.publish.session.open(recipe)",
  "s:wait_publish()",
  "p = s:begin_round()",
  "p:preflight().model_version",
  "select(2, pcall(p.start, p)).message",
  "p:init()",
  "p:start()",
  "p:chunk().chunk",
  "select(2, pcall(p.verify, p)).message",
  "#p.fills[1]",
  "p:chunk().load.chunk",
  "p:chunk().chunk",
  "pcall(p.chunk, p)",
  "p:verify()[2].manifest == s.plan.manifest",
  "select(2, pcall(p.release, p)).code",
  "#p:finish()",
  "p.result.receipts[2].tp_rank",
  "p:release().model_version",
  "s:end_round(p).verified.tensors",
  "s:state().model_version",
  "s:close()",
}, "\n") .. "\n"

describe("wsync repl with a model recipe", function()
  it("steps one publication phase by phase and shows each step's result", function()
    local result = process.wsync({ "repl", "recipes/demo.lua" }, STEPS, { timeout = 60000 })
    assert.are.equal(0, result.code, result.stderr)
    local lines = {}
    for line in result.stdout:gmatch("[^\n]+") do
      if not line:match("^wsync: ") and not line:match("^%[trainer %d%] ") then
        lines[#lines + 1] = line
      end
    end
    assert.are.same({
      "true", -- every rank is waiting in publish
      "1", -- the header's model version
      '"start needs init first"', -- out of order: refused, nothing moved
      "1", -- chunk 1 moved
      '"verify needs every chunk moved first (1 of 3 moved)"',
      "2", -- two consensus reports
      "2", -- the runtime loaded chunk 2
      "3",
      'false\t"all 3 chunks have moved"',
      "true", -- rank 1's consumed manifest is the expected one
      '"PHASE_ORDER"', -- release before finish; the publication goes on
      "2", -- two receipts
      "1", -- TP rank of the second receipt
      "1", -- committed version
      "42", -- resident tensors verified
      "1",
    }, lines)
    assert.matches("published model version 1 %(step 1%)", result.stdout)
    assert.are.same({}, orphan_segments())
  end)
end)

-- Spawns `args` with piped stdio; `on_line(line)` sees each stdout line as it
-- arrives; `on_exit(code, stdout, stderr)` runs at the end.
local function spawn(args, stdin_text, on_line, on_exit)
  local stdin, stdout, stderr = uv.new_pipe(false), uv.new_pipe(false), uv.new_pipe(false)
  local out, err, pending, code = {}, {}, "", nil
  local open = 3
  local function finish()
    open = open - 1
    if open == 0 then
      on_exit(code, table.concat(out), table.concat(err))
    end
  end
  local handle
  handle = assert(uv.spawn(process.wsync_binary(), { args = args, stdio = { stdin, stdout, stderr } },
    function(status)
      code = status
      handle:close()
      finish()
    end))
  stdout:read_start(function(_, data)
    if not data then
      stdout:close()
      return finish()
    end
    out[#out + 1] = data
    pending = pending .. data
    for line in pending:gmatch("([^\n]*)\n") do
      on_line(line)
    end
    pending = pending:match("[^\n]*$")
  end)
  stderr:read_start(function(_, data)
    if not data then
      stderr:close()
      return finish()
    end
    err[#err + 1] = data
  end)
  if stdin_text then
    stdin:write(stdin_text)
  end
  stdin:shutdown(function()
    stdin:close()
  end)
  return handle
end

-- Starts `wsync repl ARGS` in a process group of its own and plays `steps`:
-- each waits until stdout holds `expect` (after what the previous one
-- matched) or `after` ms, then writes `write`, sends SIGINT to the whole
-- group (`sigint = true`: what Ctrl-C in a terminal does) or closes stdin.
-- Returns {code, stdout, stderr}.
local function play_in_group(args, steps)
  local stdin, stdout, stderr = uv.new_pipe(false), uv.new_pipe(false), uv.new_pipe(false)
  local out, err, result = {}, {}, { code = -1 }
  local open = 3
  local function finish()
    open = open - 1
  end
  local handle, pid
  handle, pid = assert(uv.spawn(process.wsync_binary(), { args = args, stdio = { stdin, stdout, stderr },
    detached = true }, function(code, signal)
    result.code = signal ~= 0 and 128 + signal or code
    handle:close()
    finish()
  end))
  for _, pair in ipairs({ { stdout, out }, { stderr, err } }) do
    pair[1]:read_start(function(_, data)
      if data then
        pair[2][#pair[2] + 1] = data
      else
        pair[1]:close()
        finish()
      end
    end)
  end
  local timer, watchdog = uv.new_timer(), uv.new_timer()
  watchdog:start(60000, 0, function()
    uv.kill(-pid, "sigkill")
  end)
  local index, seen = 0, 1
  local function next_step()
    index = index + 1
    local step = steps[index]
    if not step then
      return
    end
    if step.expect then
      local _, last = table.concat(out):find(step.expect, seen, true)
      if not last then
        index = index - 1
        timer:start(20, 0, next_step)
        return
      end
      seen = last + 1
    elseif step.after and not step.waited then
      step.waited = true
      index = index - 1
      timer:start(step.after, 0, next_step)
      return
    end
    if step.write then
      stdin:write(step.write)
    end
    if step.sigint then
      uv.kill(-pid, "sigint")
    end
    if step.close then
      stdin:shutdown(function()
        stdin:close()
      end)
    end
    next_step()
  end
  next_step()
  while open > 0 do
    uv.run("once")
  end
  timer:close()
  watchdog:close()
  uv.run("nowait")
  result.stdout, result.stderr = table.concat(out), table.concat(err)
  return result
end

-- The lines of `text` that are neither the host's (`wsync: `) nor a child's.
local function results_of(text)
  local lines = {}
  for line in text:gmatch("[^\n]+") do
    if not line:match("^wsync: ") and not line:match("^%[trainer %d%] ") then
      lines[#lines + 1] = line
    end
  end
  return lines
end

describe("wsync repl with a session open", function()
  it("keeps the session's trainers alive when Ctrl-C interrupts a running chunk", function()
    local result = play_in_group({ "repl", "recipes/demo.lua" }, {
      { write = "s = wsync.publish.session.open(recipe) print('OPEN')\n" },
      { expect = "OPEN", write = "print('SLEEPING') wsync.loop.sleep(20000)\n" },
      { expect = "SLEEPING", sigint = true },
      { after = 500, write = table.concat({
        "s:wait_publish()",
        "uv.kill(s:state().ranks[1].pid, 0) == 0 and uv.kill(s:state().ranks[2].pid, 0) == 0",
        "s:round().model_version",
        "s:close()",
      }, "\n") .. "\n", close = true },
    })
    assert.are.equal(0, result.code, result.stderr)
    assert.are.same({ "OPEN", "SLEEPING", "true", "true", "1" }, results_of(result.stdout), result.stdout)
    -- (The sleeping chunk is no longer waited for; the ranks, told the host
    -- closed, say so as they leave.)
    assert.are.equal("interrupted (no longer waiting for the running chunk)", result.stderr:match("^[^\n]*"))
    assert.are.same({}, orphan_segments())
  end)

  it("says at once that a trainer died, and s:state() and s:wait_publish() say why", function()
    local result = process.wsync({ "repl", "recipes/demo.lua" }, table.concat({
      "s = wsync.publish.session.open(recipe)",
      "s:wait_publish()",
      "uv.kill(s:state().ranks[2].pid, 'sigkill')",
      "wsync.loop.sleep(500)",
      "s:state().ranks[2].lost",
      "s:state().failure",
      "s:wait_publish()",
      "s:close()",
    }, "\n") .. "\n", { timeout = 60000 })
    assert.are.equal(0, result.code, result.stderr)
    assert.matches("\nwsync: synthetic trainer rank 1 %(pid %d+%) exited %(signal 9%) during waiting for publish\n",
      result.stdout)
    local lines = results_of(result.stdout)
    assert.are.same({ "true", "0" }, { lines[1], lines[2] })
    assert.matches('^"agent pid %d+ closed the connection"$', lines[3])
    assert.matches('^"%[phase waiting for publish, rank 1%] trainer rank 1 was lost during waiting for publish: ',
      lines[4])
    assert.matches("^false\t<TRAINER_LOST: %[phase waiting for publish, rank 1%] trainer rank 1 was lost ", lines[5])
    assert.are.same({}, orphan_segments())
  end)

  it("prints a publication, a session and a plan as a few lines, saying how to see them whole", function()
    local result = process.wsync({ "repl", "recipes/demo.lua" }, table.concat({
      "s = wsync.publish.session.open(recipe)",
      "s:wait_publish()",
      "p = s:begin_round()",
      "p",
      "s",
      "s.plan",
      "s:close()",
    }, "\n") .. "\n", { timeout = 60000 })
    assert.are.equal(0, result.code, result.stderr)
    local lines = results_of(result.stdout)
    assert.are.equal("true", lines[1])
    for _, name in ipairs({ "p", "s", "s.plan" }) do
      local first = nil
      for index, line in ipairs(lines) do
        if line:find("show(" .. name .. ")", 1, true) then
          first = index
        end
      end
      assert.is_not_nil(first, "a hint for " .. name .. " in:\n" .. result.stdout)
    end
    assert.is_true(#lines <= 1 + 3 * 26, #lines .. " lines:\n" .. result.stdout)
  end)
end)

describe("wsync repl --attach", function()
  it("reads a running host's state without disturbing it", function()
    local script = os.tmpname()
    local file = assert(io.open(script, "w"))
    file:write([[
local recipe = require("wsync.recipe").load("recipes/demo.lua")
local s = require("wsync.publish.session").open(recipe)
s:wait_publish()
io.stdout:write("HOLDING\n")
io.stdout:flush()
-- Wait for the viewer (it connects, asks, leaves), then publish for real.
require("wsync.loop").sleep(1500)
local report = s:round()
io.stdout:write("AFTER ", tostring(report and report.model_version), "\n")
s:close()
]])
    file:close()
    local endpoint, host_result, viewer_result = nil, nil, nil
    local watchdog = uv.new_timer()
    local host = spawn({ script }, nil, function(line)
      endpoint = endpoint or line:match("control endpoint (%S+)")
      if line == "HOLDING" then
        spawn({ "repl", "--attach", endpoint }, "s = host:state()\ns.phase\ns.recipe\n#s.ranks\ns.ranks[2].publishing\n"
          .. "s.runtime.state\ns.model_version\n", function() end, function(code, stdout, stderr)
          viewer_result = { code = code, stdout = stdout, stderr = stderr }
        end)
      end
    end, function(code, stdout, stderr)
      host_result = { code = code, stdout = stdout, stderr = stderr }
      watchdog:stop()
      watchdog:close()
    end)
    watchdog:start(60000, 0, function()
      uv.process_kill(host, "sigkill")
    end)
    uv.run("default")
    os.remove(script)
    assert.is_truthy(host_result)
    assert.are.equal(0, host_result.code, host_result.stderr)
    assert.matches("AFTER 1", host_result.stdout)
    assert.is_truthy(viewer_result, "the viewer ran")
    assert.are.equal(0, viewer_result.code, viewer_result.stderr)
    assert.are.equal('"waiting for publish"\n"demo"\n2\ntrue\n"IDLE"\n0\n', viewer_result.stdout)
    assert.are.same({}, orphan_segments())
  end)

  -- Runs `wsync repl --attach PATH` with a line that would print if a REPL
  -- started; returns the ProcessResult.
  local function attach(path)
    return process.wsync({ "repl", "--attach", path }, "print('a REPL started')\n", { timeout = 15000 })
  end

  local function assert_refused(result, path, why)
    assert.are.equal(1, result.code, result.stderr)
    assert.are.equal("", result.stdout, "no REPL started")
    assert.are.equal("wsync: cannot attach to " .. path .. ": " .. why .. "\n", result.stderr)
  end

  it("fails at once, starting no REPL, when nothing exists at the endpoint", function()
    assert_refused(attach("/nonexistent/wsync.sock"), "/nonexistent/wsync.sock",
      "no such socket (nothing exists at that path)")
  end)

  it("fails at once, starting no REPL, when the endpoint is not a socket", function()
    local path = os.tmpname()
    local result = attach(path)
    os.remove(path)
    assert_refused(result, path, "not a socket (it is a regular file)")
  end)

  it("fails at once, starting no REPL, when no host listens on the socket", function()
    -- A socket file whose socket is closed: what a host that died without
    -- cleaning up leaves. (Closing a bound pipe unlinks its path: move the
    -- file away first.)
    local bound, path = os.tmpname(), os.tmpname()
    os.remove(bound)
    local server = uv.new_pipe(false)
    assert(server:bind(bound))
    assert(os.rename(bound, path))
    server:close()
    uv.run("nowait")
    local result = attach(path)
    os.remove(path)
    assert_refused(result, path, "connection refused (no host listens there: it has exited?)")
  end)
end)

describe("wsync repl with a runtime", function()
  it("spawns a reference runtime, sends commands, shows state and errors, closes it", function()
    local input = table.concat({
      "rt = wsync.runtime.spawn({ tp = 2 })",
      "rt.state",
      "rt:info().tp_world",
      "rt:request('sleep', { level = 1 }).state.weights",
      "rt:request('wake', { tags = { 'weights', 'kv_cache' } }).state.kv_cache",
      "select(2, pcall(rt.request, rt, 'generate', { prompts = { {} } })).remote_code",
      "rt.state",
      "rt:close()",
      "rt.state",
      "tostring(rt):match('CLOSED') ~= nil",
    }, "\n") .. "\n"
    local result = process.wsync({ "repl" }, input, { timeout = 30000 })
    assert.are.equal(0, result.code, result.stderr)
    local lines = {}
    for line in result.stdout:gmatch("[^\n]+") do
      lines[#lines + 1] = line
    end
    assert.are.equal('"IDLE"', lines[1])
    assert.are.equal("2", lines[2])
    assert.are.equal('"offloaded"', lines[3])
    assert.are.equal('"reserved"', lines[4])
    assert.are.equal('"INVALID_ARGUMENT"', lines[5])
    assert.are.equal('"IDLE"', lines[6]) -- a refused generate does not break it
    assert.are.equal("true", lines[7])
    assert.are.equal('"CLOSED"', lines[8])
    assert.are.equal("true", lines[9])
    assert.are.same({}, orphan_segments())
  end)
end)

describe("wsync repl ending with a session still open", function()
  local leftovers = require("tests.helpers.leftovers")

  for _, case in ipairs({
    { label = "an idle session", input = "s = wsync.publish.session.open(recipe)\n" },
    { label = "a publication stopped after its first chunk", input = table.concat({
      "s = wsync.publish.session.open(recipe)", "s:wait_publish()", "p = s:begin_round()", "p:preflight()", "p:init()",
      "p:start()", "p:chunk()", "",
    }, "\n") },
  }) do
    it("closes " .. case.label .. ": runtime, trainers, endpoint and buffers all gone", function()
      local result = leftovers.run({ "repl", "recipes/demo.lua" }, { stdin = case.input, timeout = 30000 })
      leftovers.assert_clean(result)
      assert.are.equal(0, result.code, result.stderr)
      assert.matches("control endpoint ", result.stdout, 1, true)
    end)
  end
end)
