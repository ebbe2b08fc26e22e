--- `wsync repl [RECIPE]`: interactive Lua inside the host, with wsync loaded.
---
--- Input is read through the host's libuv loop, so timers, processes and
--- connections started at the prompt keep running while it waits. Standard
--- input may be a terminal (line editing with wsync.cli.lineedit, raw mode only
--- while a line is edited), a pipe or socket, or a regular file (read with
--- fs_read, since epoll cannot watch files). Prompts and the banner appear
--- only on a terminal; otherwise only results (stdout) and errors (stderr) are
--- written, so that programs can drive the REPL.
---
--- Each line is compiled as `return <line>` first, then as a statement; input
--- that ends early (`... near '<eof>'`) waits for more lines (a long pending
--- chunk is compiled again only where it can be complete: `Scan`). A chunk runs in
--- a coroutine from wsync.loop.spawn, so `wsync.loop.await` works at the
--- prompt; lines that arrive while a chunk waits are queued and run in order
--- once it finishes. Errors print their message (wsync's own files named
--- from `scripts/`, not by the directory they are in; the traceback too
--- with WSYNC_TRACEBACK=1) and the REPL goes on. A table whose text would take
--- more than M.max_lines lines prints as a summary (wsync.cli.inspect);
--- `show(value)` prints it whole.
---
--- Ctrl-C while a chunk runs raises "interrupted" inside it (chunks run
--- interpreted: `jit.off`, so compiled loops cannot escape the hook). SIGINT
--- at other times discards pending input: a partial chunk, queued lines and a
--- chunk still waiting (it is no longer waited for), and prints "interrupted".
--- On a terminal in raw mode, Ctrl-C cancels the line being edited.
---
--- End of input or os.exit() ends the REPL; `start` returns the exit code.
--- So does a failed write to standard output (whoever read it is gone: `yes |
--- wsync repl | head`): the REPL says so on stderr and returns 1.
local bit = require("bit")
local uv = require("luv")
local stdio = require("wsync.native.stdio")
local errors = require("wsync.errors")
local host = require("wsync._host")
local inspect = require("wsync.cli.inspect")
local lineedit = require("wsync.cli.lineedit")
local loop = require("wsync.loop")

local M = {}

M.prompt = "wsync> "
M.continuation_prompt = ">> "

--- Name that chunks typed at the REPL carry in messages (`stdin:1: ...`).
M.chunk_name = "stdin"

--- The most lines a result prints whole; a longer table prints a summary.
M.max_lines = 40

--- Bytes asked for per read of a regular file.
local file_read_size = 65536

--- Lines queued before reading from a pipe pauses until they are run.
local max_queued_lines = 256

--- Lines a pending chunk may have before it is no longer compiled after every
--- line, only where it can be complete (see `Scan`).
local always_compile_lines = 64

local tty_mode_normal, tty_mode_raw = 0, 1

---@class wsync.ReplOptions
---@field recipe table?   a validated recipe (wsync.recipe.load), exposed as `recipe`
---@field globals table?  more names for the REPL's environment (`host` when attached)
---@field input string?   read this text instead of standard input, as if piped (tests)
---@field output file*?   where results go (default io.stdout): anything with write(self, text)
---@field errors file*?   where errors go (default io.stderr): anything with write(self, text)

---@class wsync.ReplSession
---@field env table              globals of the typed chunks; __index is _G
---@field queue string[]         complete lines waiting to run
---@field chunk_lines string[]   lines of the chunk being typed (incomplete so far)
---@field chunk_scan wsync.ReplScan  what those lines leave open
---@field partial string         bytes of a line whose newline has not arrived
---@field current table?         the chunk running or waiting, if any
---@field eof boolean            input ended
---@field finished boolean
---@field exit_code integer
---@field editor wsync.LineEditor?  on a terminal
---@field tty userdata?          uv_tty_t for standard input
---@field stream userdata?       uv_pipe_t / uv_tcp_t for standard input
---@field source string          "tty", "stream", "file", "string" or "none"
---@field input_ended boolean    the terminal reported end of input (keys typed before it still count)
---@field raw boolean?           the terminal is in raw mode
---@field paused boolean?        reading the stream stopped: `max_queued_lines` are waiting
---@field reading boolean?       a read of the regular file is in flight
---@field pumping boolean?       `_pump` is running (it does not nest)
---@field running boolean?       `start` is inside uv.run
---@field on_read function?      the stream's read callback
---@field handles userdata[]     every handle the session opened; closed at the end
---@field output file*
---@field errors file*
---@field previous_error_handler fun(err: any)  wsync.loop's handler before the REPL's
local Session = {}
Session.__index = Session

local is_exit_sentinel = errors.is_exit
local pack = require("wsync.util").pack

-- Compiles `source` as an expression, else as a statement. Returns the
-- function, whether it is an expression and whether it packs its results
-- (below); or nil, false, the compile error and whether that error only says
-- that the input ended too early.
--
-- An expression runs as `local pack = ...; return pack(<source>\n)` where it
-- can: `return f()` would be a tail call, and a tail-called function (error,
-- assert) loses the chunk's frame and with it the `stdin:1:` position.
local function compile(source)
  local chunk_name = "=" .. M.chunk_name
  local fn, expression_message = loadstring("return " .. source, chunk_name)
  if fn then
    local packing = loadstring("local _repl_pack = ...; return _repl_pack(" .. source .. "\n)", chunk_name)
    return packing or fn, true, packing ~= nil
  end
  local message
  fn, message = loadstring(source, chunk_name)
  if fn then
    return fn, false
  end
  local function ends_early(text)
    -- A short string cannot span lines: "unfinished string" is a real error.
    return text:match("near '<eof>'$") ~= nil and not text:find("unfinished string", 1, true)
  end
  return nil, false, message, ends_early(message) or ends_early(expression_message)
end

-- What the lines of a pending chunk leave open, kept up to date line by line
-- so that a long chunk is not recompiled at every line (quadratic: a piped
-- 20,000-line table literal took 10.2 s, now 0.10 s; tests/bench/RESULTS.md).
-- In Lua 5.1 every keyword is reserved, so in text without syntax errors
-- `function`, `do`, `if` and `repeat` each open one block that one `end` or
-- `until` closes (`while` and `for` open theirs with `do`, `elseif` none):
-- while a bracket or block is open, or a long string or comment goes on, the
-- chunk cannot be complete and compiling it would only say "near '<eof>'".
-- Text with an error can look open when it is not; its error then shows when
-- the chunk closes, at the latest when its line count reaches a power of two.
---@class wsync.ReplScan
---@field depth integer        brackets and blocks opened and not closed (negative: more closed)
---@field long_close string?   the `]==]` that ends the long string or comment the text is in
---@field broken boolean?      a short string ends with its line: a real error, to report now
local Scan = {}
Scan.__index = Scan

local block_depth = { ["function"] = 1, ["do"] = 1, ["if"] = 1, ["repeat"] = 1, ["end"] = -1, ["until"] = -1 }
local bracket_depth = { ["("] = 1, ["{"] = 1, ["["] = 1, [")"] = -1, ["}"] = -1, ["]"] = -1 }

local function new_scan()
  return setmetatable({ depth = 0 }, Scan)
end

-- Takes in the next line of the chunk.
function Scan:add(line)
  local position = 1
  while true do
    if self.long_close then
      local _, last = line:find(self.long_close, position, true)
      if not last then
        return
      end
      self.long_close, position = nil, last + 1
    end
    local start, _, char = line:find("([%w_%-%[%]%(%){}\"'])", position)
    if not start then
      return
    end
    position = start + 1
    if char:find("^[%a_]") then
      local word = line:match("^[%w_]+", start)
      self.depth = self.depth + (block_depth[word] or 0)
      position = start + #word
    elseif char:find("^%d") then
      position = start + #line:match("^[%w_.]+", start) -- a number, `0xfe` and `1e5` too
    elseif char == "-" then
      if line:sub(position, position) == "-" then
        local level = line:match("^%[(=*)%[", position + 1)
        if not level then
          return -- a comment to the end of the line
        end
        self.long_close, position = "]" .. level .. "]", position + 3 + #level
      end
    elseif char == "[" and line:find("^%[=*%[", start) then
      local level = line:match("^%[(=*)%[", start)
      self.long_close, position = "]" .. level .. "]", start + 2 + #level
    elseif char == '"' or char == "'" then
      while true do
        local next_stop, _, stop = line:find("([\\" .. char .. "])", position)
        if not next_stop then
          self.broken = true
          return
        end
        position = next_stop + (stop == "\\" and 2 or 1)
        if stop == char then
          break
        end
      end
    else
      self.depth = self.depth + bracket_depth[char]
    end
  end
end

-- Whether the lines taken in so far can make a complete chunk (or a syntax
-- error worth reporting now).
function Scan:can_end()
  return self.broken or (self.long_close == nil and self.depth <= 0)
end

-- Cuts the REPL's own frames off a traceback: everything below the typed
-- chunk's main frame.
local function trim_traceback(traceback)
  local keep = nil
  local pattern = "\n%s*" .. M.chunk_name:gsub("%p", "%%%0") .. ":%d+: in main chunk"
  local position = 1
  while true do
    local _, last = traceback:find(pattern, position)
    if not last then
      break
    end
    keep, position = last, last + 1
  end
  return keep and traceback:sub(1, keep) or traceback
end

-- Cuts the frames of the loop that the REPL runs off a callback's traceback.
local function trim_loop_frames(traceback)
  local cut = traceback:find("\n%s*%[C%]: in function 'run'\n[^\n]*repl%.lua")
  return cut and traceback:sub(1, cut - 1) or traceback
end

-- An error of a typed chunk that is not a wsync error object: its message
-- and its traceback, apart.
local ChunkError = {}

-- Message handler for typed chunks: adds the traceback, passes the exit
-- sentinel and keeps wsync error objects as objects.
local function chunk_message_handler(err)
  if is_exit_sentinel(err) then
    return err
  end
  local traceback = trim_traceback(debug.traceback("", 2)):gsub("^\n", "")
  if errors.is(err) then
    err.traceback = err.traceback or traceback
    return err
  end
  local message
  if type(err) == "string" then
    message = err
  else
    local meta = getmetatable(err)
    if type(meta) == "table" and meta.__tostring then
      message = tostring(err)
    else
      message = "(error object) " .. inspect.inspect(err)
    end
  end
  return setmetatable({ message = message, traceback = traceback }, ChunkError)
end

-- `text` with the directory of wsync's scripts written as `scripts/`, as the
-- scripts embedded in the binary are named: a message says which of wsync's
-- files, not where this checkout lies.
local function short_paths(text)
  local root = host.script_root()
  if root then
    local escaped = (root:gsub("/+$", "") .. "/"):gsub("%p", "%%%0")
    text = text:gsub("@?" .. escaped, "scripts/")
  end
  return text
end

--- The text of an error for a person: its message, and with
--- WSYNC_TRACEBACK=1 its traceback.
---@param err any
---@return string
function M.error_text(err)
  local verbose = os.getenv("WSYNC_TRACEBACK") == "1"
  local text
  if getmetatable(err) == ChunkError then
    text = err.message .. (verbose and ("\n" .. err.traceback) or "")
  elseif type(err) == "string" and not verbose then
    -- (A callback's error comes with the traceback of its protected call.)
    text = err:match("^(.-)\nstack traceback:\n") or err
  else
    text = errors.format(err, verbose)
  end
  return short_paths(text)
end

local function write_to(sink, text)
  sink:write(text)
  if sink.flush then
    sink:flush()
  end
end

function Session:_write_result(text)
  write_to(self.output, text)
end

function Session:_write_error(text)
  io.stdout:flush()
  write_to(self.errors, text:sub(-1) == "\n" and text or text .. "\n")
end

-- Puts the terminal in raw mode (editing) or normal mode (a chunk runs).
function Session:_set_raw(raw)
  if self.tty and self.raw ~= raw then
    self.tty:set_mode(raw and tty_mode_raw or tty_mode_normal)
    self.raw = raw
  end
end

function Session:_finish(code)
  if not self.finished then
    self.finished = true
    self.exit_code = code or 0
    if self.running then
      uv.stop()
    end
  end
end

-- A result as the REPL prints it: a wsync error object as its code and
-- text, a table too long to print whole as a summary whose hint prints it
-- (`source`: the expression typed, when it is short), anything else whole.
local function result_text(value, source)
  if errors.is(value) then
    return string.format("<%s: %s>", tostring(value.code), short_paths(tostring(value)))
  end
  local text = inspect.inspect(value)
  if type(value) == "table" then
    local _, newlines = text:gsub("\n", "")
    if newlines + 1 > M.max_lines then
      local name = source and #source <= 40 and not source:find("[\n;]") and source or "value"
      return inspect.summary(value, newlines + 1, string.format("show(%s) prints it whole", name))
    end
  end
  return text
end

-- Prints what a chunk returned: nothing for a statement that returned only
-- nils, the values separated by tabs otherwise. `source` is the chunk's text.
function Session:_print_results(is_expression, results, source)
  if results.n == 0 then
    return
  end
  if not is_expression then
    local any = false
    for index = 1, results.n do
      any = any or results[index] ~= nil
    end
    if not any then
      return
    end
  end
  local ok, text = pcall(function()
    local texts = {}
    for index = 1, results.n do
      texts[index] = result_text(results[index], results.n == 1 and is_expression and source or nil)
    end
    return table.concat(texts, "\t")
  end)
  if ok then
    self:_write_result(text .. "\n")
  else
    self:_write_error("cannot print the result: " .. tostring(text))
  end
end

function Session:_report_chunk_error(err)
  if is_exit_sentinel(err) then
    self:_finish(err.code)
    return
  end
  local text = M.error_text(err)
  if self.tty and text:match("^interrupted") then
    text = "\n" .. text -- after the terminal's echo of ^C
  end
  self:_write_error(text)
end

-- Runs a compiled chunk in a coroutine from wsync.loop.spawn, with Ctrl-C
-- armed around each of its resumes. Its outcome is printed when it finishes,
-- now or after it waited. A `packing` chunk takes `pack` as its argument and
-- returns its results packed.
function Session:_run_chunk(fn, is_expression, packing, source)
  setfenv(fn, self.env)
  jit.off(fn, true)
  local chunk = {}
  self.current = chunk
  self:_set_raw(false)

  -- The outcome travels as one table (results, error or the exit sentinel).
  local function body()
    loop.set_resume_hooks(coroutine.running(), host.arm_interrupt, host.disarm_interrupt)
    local outcome
    if packing then
      outcome = pack(xpcall(fn, chunk_message_handler, pack))
    else
      outcome = pack(xpcall(fn, chunk_message_handler))
    end
    if not outcome[1] then
      return { ok = false, err = outcome[2] }
    end
    return { ok = true, results = packing and outcome[2] or pack(unpack(outcome, 2, outcome.n)) }
  end
  local function on_done(resumed, outcome)
    if self.current ~= chunk then
      return -- abandoned by an interrupt
    end
    self.current = nil
    io.stdout:flush() -- what the chunk printed comes before its results
    if not resumed then
      self:_report_chunk_error(outcome)
    elseif outcome.ok then
      self:_print_results(is_expression, outcome.results, source)
    else
      self:_report_chunk_error(outcome.err)
    end
    io.stdout:flush()
    -- Whoever read the output is gone: stop running chunks whose output
    -- nobody sees.
    if self.output == io.stdout and stdio.stdout_failed() then
      self:_write_error("wsync repl: standard output is closed; leaving")
      self:_finish(1)
      return
    end
    self:_pump()
  end

  host.arm_interrupt()
  local ok, err = pcall(loop.spawn, body, on_done)
  host.disarm_interrupt()
  if not ok and self.current == chunk then
    -- Interrupted between arming and the first resume.
    self.current = nil
    self:_report_chunk_error(err)
  end
end

-- Forgets the chunk being typed.
function Session:_drop_chunk()
  self.chunk_lines, self.chunk_scan = {}, new_scan()
end

-- Adds `line` to the chunk being typed; runs the chunk once it compiles. A
-- long chunk is compiled only where it can be complete, and when its line
-- count is a power of two (so that an error inside it shows, at linear cost).
function Session:_handle_line(line)
  if #self.chunk_lines == 0 then
    if not line:find("%S") then
      return
    end
    line = line:gsub("^%s*=", "", 1) -- `=expr` as in lua 5.1: the same as `expr`
  end
  local lines = self.chunk_lines
  lines[#lines + 1] = line
  self.chunk_scan:add(line)
  local count = #lines
  if count > always_compile_lines and not self.chunk_scan:can_end() and bit.band(count, count - 1) ~= 0 then
    return
  end
  local source = table.concat(lines, "\n")
  local fn, is_expression, detail, ends_early = compile(source)
  if fn then
    self:_drop_chunk()
    self:_run_chunk(fn, is_expression, detail, (source:gsub("^%s+", ""):gsub("%s+$", "")))
  elseif not ends_early then
    self:_drop_chunk()
    self:_write_error(detail)
  end
end

-- Handles what the editor reports at the end of a line.
function Session:_on_editor_event(event)
  if event.kind == "line" then
    self.queue[#self.queue + 1] = event.text
  elseif event.kind == "eof" then
    self.eof = true
  elseif event.kind == "cancel" then
    self:_drop_chunk()
  end
end

-- Takes what a read of standard input gave: `data`, its end (nil; "" from a
-- file) or a read error `err`.
function Session:_take_input(err, data)
  if self.finished then
    return
  end
  if err then
    self:_write_error("wsync repl: cannot read standard input: " .. tostring(err))
    self:_receive_eof()
  elseif data == nil or data == "" then
    self:_receive_eof()
  else
    self:_receive(data)
  end
end

function Session:_read_file()
  if self.reading then
    return
  end
  self.reading = true
  uv.fs_read(0, file_read_size, -1, function(err, data)
    self.reading = false
    self:_take_input(err, data)
  end)
end

-- The REPL's driver: runs queued lines in order while no chunk is running,
-- then asks for more input (or ends at end of input). Safe to call from any
-- callback; a nested call returns at once and the outer one goes on.
function Session:_pump()
  if self.pumping then
    return
  end
  self.pumping = true
  while not self.finished and not self.current do
    local line = table.remove(self.queue, 1)
    if line then
      self:_handle_line(line)
    elseif self.eof then
      -- Input that ends inside a chunk was cut short: say so, exit 1.
      local cut_short = #self.chunk_lines > 0
      if cut_short then
        local _, _, message = compile(table.concat(self.chunk_lines, "\n"))
        self:_drop_chunk()
        self:_write_error(message)
      end
      self:_finish(cut_short and 1 or 0)
    elseif self.editor then
      if not self.editor.active then
        self:_set_raw(true)
        self.editor:start(#self.chunk_lines > 0 and M.continuation_prompt or M.prompt)
      end
      local event = self.editor:feed("")
      if event then
        self:_on_editor_event(event)
      elseif self.input_ended then
        self.editor:cancel()
        self.eof = true
      else
        break
      end
    else
      if self.paused then
        self.paused = false
        self.stream:read_start(self.on_read)
      elseif self.source == "file" then
        self:_read_file()
      end
      break
    end
  end
  self.pumping = false
end

-- Queues the complete lines in `data` (bytes from a pipe, file or string).
function Session:_receive(data)
  if self.editor then
    local event = self.editor:feed(data)
    if event then
      self:_on_editor_event(event)
    end
    self:_pump()
    return
  end
  local text = self.partial .. data
  local position = 1
  while true do
    local newline = text:find("\n", position, true)
    if not newline then
      break
    end
    self.queue[#self.queue + 1] = (text:sub(position, newline - 1):gsub("\r$", ""))
    position = newline + 1
  end
  self.partial = text:sub(position)
  if self.stream and #self.queue >= max_queued_lines and not self.paused then
    self.stream:read_stop()
    self.paused = true
  end
  self:_pump()
end

function Session:_receive_eof()
  if self.editor then
    -- Keys typed ahead are still handled; the end comes after them.
    self.input_ended = true
    self:_pump()
    return
  end
  if self.partial ~= "" then
    self.queue[#self.queue + 1] = self.partial
    self.partial = ""
  end
  self.eof = true
  self:_pump()
end

-- SIGINT outside a running chunk: drops pending input and the chunk that is
-- waiting, says so, and waits for new input.
function Session:_interrupt()
  if self.finished then
    return
  end
  local abandoned = self.current ~= nil
  self.current = nil
  self:_drop_chunk()
  self.queue, self.partial = {}, ""
  if self.editor then
    self.editor:cancel()
  end
  self:_write_error(abandoned and "interrupted (no longer waiting for the running chunk)" or "interrupted")
  self:_pump()
end

-- The text `help()` prints.
function Session:_help_text()
  local lines = {
    string.format("wsync %s REPL: each input runs as Lua, results are printed.", require("wsync").version),
    "  wsync    the wsync module; wsync.loop, wsync.recipe, wsync.native.manifest, ... load on use",
    "  uv       libuv (luv): timers and processes keep running while the REPL waits",
  }
  local recipe = rawget(self.env, "recipe")
  if recipe then
    lines[#lines + 1] = "  recipe   the recipe from the command line (recipe.name, recipe.params, recipe.run)"
  end
  if recipe and recipe.model then
    lines[#lines + 1] = "  step through publications:"
    lines[#lines + 1] = "    s = wsync.publish.session.open(recipe)   trainers, runtime, bootstrap; "
      .. "s.plan, s.plan.chunks[k]"
    lines[#lines + 1] = "    s:wait_publish(); p = s:begin_round()   the schedule up to publish"
    lines[#lines + 1] = "    p:preflight() p:init() p:start() p:chunk() ... p:verify() p:finish() p:release()"
    lines[#lines + 1] = "    p.header, p.fills[k] (consensus reports), p.loads[k], p.consumed, p.result.receipts"
    lines[#lines + 1] = "    s:end_round(p); s:state(); s:close()"
  end
  if rawget(self.env, "host") then
    lines[#lines + 1] = "  host     the attached host (read-only): host:state() is a fresh snapshot"
  end
  lines[#lines + 1] = "  a long table prints as a summary: show(x) prints it whole, show(x, 2) two levels deep"
  lines[#lines + 1] = "  errors print their message; WSYNC_TRACEBACK=1 adds the traceback"
  lines[#lines + 1] = "  wsync.loop.await and wsync.loop.sleep work here: each input runs in a coroutine"
  lines[#lines + 1] = "  locals last one input; globals (x = 1) stay in the REPL's own environment"
  lines[#lines + 1] = "  Ctrl-C interrupts a running chunk; Ctrl-D (end of input) or os.exit() leaves"
  return table.concat(lines, "\n") .. "\n"
end

function Session:_make_env(recipe, globals)
  local env = setmetatable({}, { __index = _G })
  env.wsync = require("wsync")
  env.uv = uv
  env.recipe = recipe
  for name, value in pairs(globals or {}) do
    env[name] = value
  end
  env.help = function()
    self:_write_result(self:_help_text())
  end
  env.show = function(value, depth)
    self:_write_result(inspect.inspect(value, { depth = depth }) .. "\n")
  end
  return env
end

-- Opens standard input (or the test input) and starts reading it.
function Session:_open_input(options)
  if options.input then
    self.source = "string"
    local timer = uv.new_timer()
    self.handles[#self.handles + 1] = timer
    timer:start(0, 0, function()
      self:_receive(options.input)
      self:_receive_eof()
    end)
    return
  end
  local kind = uv.guess_handle(0)
  if kind == "tty" then
    self.source = "tty"
    self.tty = assert(uv.new_tty(0, true))
    self.handles[#self.handles + 1] = self.tty
    local terminal = uv.guess_handle(1) == "tty" and io.stdout or io.stderr
    self.editor = lineedit.new({
      write = function(text)
        write_to(terminal, text)
      end,
    })
    write_to(terminal, string.format("wsync %s REPL: help() says what is here; Ctrl-D leaves\n",
      require("wsync").version))
    self.stream = self.tty
  elseif kind == "pipe" or kind == "tcp" then
    self.source = "stream"
    self.stream = assert(kind == "pipe" and uv.new_pipe(false) or uv.new_tcp())
    self.handles[#self.handles + 1] = self.stream
    assert(self.stream:open(0))
  elseif kind == "file" then
    self.source = "file"
    return
  else
    self.source = "none"
    self.eof = true
    return
  end
  self.on_read = function(err, data)
    self:_take_input(err, data)
  end
  self.stream:read_start(self.on_read)
end

-- Closes what the session opened and puts back what it replaced.
function Session:_close()
  host.disarm_interrupt()
  if self.tty then
    pcall(self.tty.set_mode, self.tty, tty_mode_normal)
    uv.tty_reset_mode()
  end
  for _, handle in ipairs(self.handles) do
    if not handle:is_closing() then
      handle:close()
    end
  end
  loop.set_error_handler(self.previous_error_handler)
end

--- Runs the REPL until end of input or os.exit(); returns the exit code (0
--- at end of input, os.exit's code otherwise). The loop runs inside: call it
--- from outside any libuv callback.
---@param options wsync.ReplOptions?
---@return integer
function M.start(options)
  options = options or {}
  local self = setmetatable({
    queue = {},
    partial = "",
    eof = false,
    finished = false,
    exit_code = 0,
    handles = {},
    output = options.output or io.stdout,
    errors = options.errors or io.stderr,
  }, Session)
  self:_drop_chunk()
  self.env = self:_make_env(options.recipe, options.globals)

  local ok, err = xpcall(function()
    self.previous_error_handler = loop.set_error_handler(function(callback_error)
      if is_exit_sentinel(callback_error) then
        self:_finish(callback_error.code)
      else
        if errors.is(callback_error) and type(callback_error.traceback) == "string" then
          callback_error.traceback = trim_loop_frames(callback_error.traceback)
        elseif type(callback_error) == "string" then
          callback_error = trim_loop_frames(callback_error)
        end
        self:_write_error("error in a callback: " .. M.error_text(callback_error))
      end
    end)
    self:_open_input(options)
    local signal = uv.new_signal()
    self.handles[#self.handles + 1] = signal
    signal:start("sigint", function()
      self:_interrupt()
    end)
    self:_pump()
    while not self.finished do
      self.running = true
      uv.run("default")
      self.running = false
      if not self.finished and not uv.loop_alive() then
        self:_finish(0)
      end
    end
    -- Sessions opened here and not closed: close them (runtime, trainers,
    -- endpoint, buffers) rather than leave them to the process's exit.
    local sessions = package.loaded["wsync.publish.session"]
    if sessions and next(sessions.open_sessions) then
      local closed = false
      loop.spawn(sessions.close_all, function()
        closed = true
      end)
      loop.run_until(function()
        return closed
      end)
    end
  end, debug.traceback)
  self:_close()
  uv.run("nowait") -- complete the closes
  if not ok then
    error(err, 0)
  end
  return self.exit_code
end

return M
