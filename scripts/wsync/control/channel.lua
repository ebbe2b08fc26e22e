--- A framed message channel over one libuv stream (a pipe or socket end).
---
--- `channel.new(stream, {limit, on_message, on_close})` starts reading:
--- every decoded message goes to `on_message(message)`; the first EOF, read
--- error or bad frame goes to `on_close(reason)` once, after which the channel
--- is closed. `send(message)` encodes and writes one frame. A frame whose
--- announced length is over `limit` (default wsync.control.protocol.MAX_FRAME)
--- is refused at its 4-byte prefix, before any of its body is buffered;
--- `set_limit` changes the limit (a TCP connection's grows once it has proved
--- its token, wsync.control.endpoint).
local protocol = require("wsync.control.protocol")

local M = {}

---@class wsync.Channel
---@field stream userdata
---@field closed boolean
local Channel = {}
Channel.__index = Channel

---@param stream userdata  a luv stream handle, open
---@param options {limit: integer?, on_message: fun(message: table), on_close: fun(reason: string)}
---@return wsync.Channel
function M.new(stream, options)
  local self = setmetatable({
    stream = stream,
    closed = false,
    limit = options.limit or protocol.MAX_FRAME,
    on_message = options.on_message,
    on_close = options.on_close,
  }, Channel)
  self.decoder = protocol.decoder(self.limit)
  stream:read_start(function(err, data)
    if self.closed then
      return
    end
    if err then
      return self:_end("read error: " .. tostring(err))
    end
    if data == nil then
      return self:_end("EOF")
    end
    local messages, reason, before = self.decoder:push(data)
    if not messages then
      -- What arrived whole before the bad frame is delivered first, however
      -- the bytes were split into reads.
      for _, message in ipairs(before or {}) do
        if self.closed then
          return
        end
        self.on_message(message)
      end
      return self:_end(reason)
    end
    for _, message in ipairs(messages) do
      if self.closed then
        return
      end
      self.on_message(message)
    end
  end)
  return self
end

function Channel:_end(reason)
  if self.closed then
    return
  end
  self:close()
  if self.on_close then
    self.on_close(reason)
  end
end

--- Encodes and writes one message. Returns true, or nil and a reason when the
--- channel is closed or the message is too large.
---@param message table
function Channel:send(message)
  if self.closed then
    return nil, "channel is closed"
  end
  local ok, frame = pcall(protocol.encode, message, self.limit)
  if not ok then
    return nil, frame
  end
  return self:send_raw(frame)
end

--- Sets the limit on the frames read and sent from now on, in bytes.
---@param limit integer
function Channel:set_limit(limit)
  self.limit = limit
  if self.decoder then
    self.decoder.limit = limit
  end
end

--- Sends `message` as the last one: stops reading now, writes it, and closes
--- the stream once it is written (the other end reads it, then EOF). The
--- channel counts as closed at once; `on_close` does not run.
---@param message table
function Channel:send_last(message)
  if self.closed then
    return
  end
  local ok, frame = pcall(protocol.encode, message, self.limit)
  self.closed = true
  self.decoder = nil
  local stream = self.stream
  if stream:is_closing() then
    return
  end
  stream:read_stop()
  if ok and stream:write(frame) then
    stream:shutdown(function()
      if not stream:is_closing() then
        stream:close()
      end
    end)
  else
    stream:close()
  end
end

--- Writes bytes as they are (tests use it to send malformed frames).
---@param bytes string
function Channel:send_raw(bytes)
  if self.closed then
    return nil, "channel is closed"
  end
  local ok, err = self.stream:write(bytes)
  if not ok then
    return nil, "write failed: " .. tostring(err)
  end
  return true
end

--- Stops reading and closes the stream. Safe to call twice.
function Channel:close()
  if self.closed then
    return
  end
  self.closed = true
  -- (What a partial frame left buffered goes with it, whoever still holds
  -- the channel.)
  self.decoder = nil
  if not self.stream:is_closing() then
    self.stream:read_stop()
    self.stream:close()
  end
end

return M
