--- Children's output, relayed by the process that started them: a child's
--- stdout and stderr are pipes that this process reads, and each whole line
--- goes to this process's own stdout or stderr with a prefix naming the child
--- (`[trainer 1] `, `[runtime] `), written at once. Lines of different
--- processes never cut into each other, in a terminal or a file, and each
--- child's lines come in its order. A line that does not end within
--- M.MAX_LINE bytes is written as it is, ended; so is what a child leaves
--- unended when its pipe closes.
---
--- Only where this process runs its loop all the time (the `wsync` command:
--- M.enable): a trainer that embeds libwsync runs wsync's loop only inside its
--- calls, and a child whose pipe filled meanwhile would stop in its write.
--- There (M.new returns nil) children write to this process's stdout and
--- stderr themselves, line-buffered as the wsync binary's are.
---
--- The pipes do not keep the loop alive; a process that ends its children
--- waits for their last lines with M.drain.
local uv = require("luv")
local loop = require("wsync.loop")

local M = {}

--- The longest line kept whole, in bytes; a longer one is cut there.
M.MAX_LINE = 65536

local enabled = false
local open_relays = {}
local ended = loop.condition()

--- Makes this process relay its children's output (M.new) from now on, or
--- (`false`) not.
---@param on boolean?
function M.enable(on)
  enabled = on ~= false
end

---@class wsync.OutputRelay
---@field prefix string
---@field stdout userdata  the child's stdout: uv.spawn's stdio[2]
---@field stderr userdata  the child's stderr: uv.spawn's stdio[3]
local Relay = {}
Relay.__index = Relay

--- A relay for one child whose lines get `prefix`, or nil when this process
--- does not relay (M.enable): give `relay.stdout` and `relay.stderr` to
--- uv.spawn, then call `relay:start()`, or `relay:close()` if the spawn
--- failed.
---@param prefix string
---@return wsync.OutputRelay?
function M.new(prefix)
  if not enabled then
    return nil
  end
  return setmetatable({ prefix = prefix, stdout = uv.new_pipe(false), stderr = uv.new_pipe(false), open = 0 },
    Relay)
end

-- Writes `text` (whole lines) to `sink` at once.
local function emit(sink, text)
  sink:write(text)
  sink:flush()
end

-- Reads `pipe` and writes its whole lines to `sink`, each with the prefix.
function Relay:_read(pipe, sink)
  local partial = ""
  self.open = self.open + 1
  pipe:read_start(function(err, data)
    if data then
      local text = partial .. data
      local lines = {}
      local position = 1
      while true do
        local newline = text:find("\n", position, true)
        -- (A line longer than M.MAX_LINE is cut, whether its end came in
        -- this read or is still to come.)
        if (newline or #text + 1) - position > M.MAX_LINE then
          lines[#lines + 1] = self.prefix .. text:sub(position, position + M.MAX_LINE - 1) .. "\n"
          position = position + M.MAX_LINE
        elseif newline then
          lines[#lines + 1] = self.prefix .. text:sub(position, newline)
          position = newline + 1
        else
          break
        end
      end
      partial = text:sub(position)
      if #lines > 0 then
        emit(sink, table.concat(lines))
      end
      return
    end
    -- EOF, or a read error (`err`): nothing more comes.
    if partial ~= "" then
      emit(sink, self.prefix .. partial .. "\n")
      partial = ""
    end
    if err then
      emit(io.stderr, string.format("%scannot read its output: %s\n", self.prefix, tostring(err)))
    end
    self:_close_pipe(pipe)
  end)
  pipe:unref()
end

function Relay:_close_pipe(pipe)
  if not pipe:is_closing() then
    pipe:close()
    self.open = self.open - 1
    if self.open == 0 then
      open_relays[self] = nil
      ended:notify()
    end
  end
end

--- Starts relaying, once the child was spawned with the relay's pipes.
function Relay:start()
  open_relays[self] = true
  self:_read(self.stdout, io.stdout)
  self:_read(self.stderr, io.stderr)
end

--- After the spawn of its child: starts relaying when the child started
--- (`started`), closes the pipes otherwise.
---@param started boolean
function Relay:spawned(started)
  if started then
    self:start()
  else
    self:close()
  end
end

--- Closes the pipes of a relay that was never started (the spawn failed).
function Relay:close()
  for _, pipe in ipairs({ self.stdout, self.stderr }) do
    if not pipe:is_closing() then
      pipe:close()
    end
  end
end

--- Waits, at most `seconds`, until every started relay has read its child's
--- last line (every process that held its pipes has ended). Must run in a
--- coroutine of wsync.loop.spawn. Returns whether they all did.
---@param seconds number
---@return boolean
function M.drain(seconds)
  return ended:wait_for(seconds, function()
    return next(open_relays) == nil
  end)
end

return M
