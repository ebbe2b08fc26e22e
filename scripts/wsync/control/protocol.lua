--- The control protocol between the host and the processes it drives.
---
--- A frame is a 4-byte big-endian length followed by that many bytes of JSON.
--- A request is `{protocol, id, cmd, payload}`; a response echoes `protocol, id,
--- cmd` and carries `ok = true, result = {...}` or `ok = false, error = {code,
--- message, traceback?, fatal?}`. Both ends use this one module to encode and
--- decode; a frame over the size limit, or one that is not a JSON object, ends
--- the connection.
local cjson = require("cjson")
local bit = require("bit")

local M = {}

--- Protocol version spoken by this build. A peer speaking another is refused
--- at its first frame.
M.VERSION = 1

--- Default hard limit on one frame's body, in bytes.
M.MAX_FRAME = 16 * 1024 * 1024

local decode_json = cjson.new().decode
local encoder = cjson.new()
encoder.encode_sparse_array(true)
local encode_json = encoder.encode

local function length_prefix(length)
  return string.char(
    bit.band(bit.rshift(length, 24), 255),
    bit.band(bit.rshift(length, 16), 255),
    bit.band(bit.rshift(length, 8), 255),
    bit.band(length, 255))
end

--- Encodes one message (a table) as a frame. Raises when the body exceeds
--- `limit` (default M.MAX_FRAME): the sender learns before the peer breaks.
---@param message table
---@param limit integer?
---@return string frame
function M.encode(message, limit)
  local body = encode_json(message)
  if #body > (limit or M.MAX_FRAME) then
    error(string.format("frame of %d bytes exceeds the %d-byte limit", #body, limit or M.MAX_FRAME), 2)
  end
  return length_prefix(#body) .. body
end

--- Builds a request message.
---@param id integer
---@param cmd string
---@param payload table?
function M.request(id, cmd, payload)
  return { protocol = M.VERSION, id = id, cmd = cmd, payload = payload or {} }
end

--- Builds a successful response to `request`.
---@param request table
---@param result table
function M.success(request, result)
  return { protocol = M.VERSION, id = request.id, cmd = request.cmd, ok = true, result = result or {} }
end

--- Request ids: integers from 0 to 2^53 (a Lua number holds them exactly, and
--- a frame can carry them back in the answer).
M.MAX_ID = 2 ^ 53

--- Builds a failed response to `request`. `fatal` tells the client that the
--- responding process can no longer be trusted (it must be destroyed).
---@param request table
---@param code string
---@param message string
---@param fields table? traceback, fatal, and details
function M.failure(request, code, message, fields)
  local err = { code = code, message = message }
  for key, value in pairs(fields or {}) do
    err[key] = value
  end
  return { protocol = M.VERSION, id = request.id, cmd = request.cmd, ok = false, error = err }
end

---@class wsync.FrameDecoder
---@field limit integer
local Decoder = {}
Decoder.__index = Decoder

--- A streaming decoder: `decoder:push(bytes)` returns the list of complete
--- messages, or nil and a reason once the stream is bad (oversize frame,
--- undecodable body), plus the list of the complete messages that came before
--- the bad frame in this push. After a failure every push fails with the same
--- reason.
---@param limit integer?
---@return wsync.FrameDecoder
function M.decoder(limit)
  return setmetatable({ limit = limit or M.MAX_FRAME, chunks = {}, size = 0, failed = nil }, Decoder)
end

-- Joins the buffered chunks into one string (only when a whole frame, or a
-- length prefix split across chunks, is waiting: each byte is joined once).
function Decoder:_join()
  if #self.chunks > 1 then
    self.chunks = { table.concat(self.chunks) }
  end
  return self.chunks[1]
end

function Decoder:push(data)
  if self.failed then
    return nil, self.failed
  end
  if data and #data > 0 then
    self.chunks[#self.chunks + 1] = data
    self.size = self.size + #data
  end
  local messages = {}
  while self.size >= 4 do
    local buffer = self.chunks[1]
    if #buffer < 4 then
      buffer = self:_join()
    end
    local b1, b2, b3, b4 = buffer:byte(1, 4)
    local length = ((b1 * 256 + b2) * 256 + b3) * 256 + b4
    if length > self.limit then
      self.failed = string.format("frame of %d bytes exceeds the %d-byte limit", length, self.limit)
      return nil, self.failed, messages
    end
    if self.size < 4 + length then
      break
    end
    buffer = self:_join()
    local body = buffer:sub(5, 4 + length)
    local rest = buffer:sub(5 + length)
    self.chunks = rest ~= "" and { rest } or {}
    self.size = #rest
    local ok, message = pcall(decode_json, body)
    if not ok or type(message) ~= "table" or not body:find("^%s*{") then
      -- (cjson decodes an array as a table too: the body's first character
      -- tells an object from an array.)
      local kind = type(message) == "table" and "array" or type(message)
      self.failed = "undecodable frame: " .. (ok and ("a JSON " .. kind .. ", not an object") or tostring(message))
      return nil, self.failed, messages
    end
    messages[#messages + 1] = message
  end
  return messages
end

-- Shape checks shared by both ends -------------------------------------------

local function is_id(value)
  return type(value) == "number" and value >= 0 and value <= M.MAX_ID and value == math.floor(value)
end

--- Checks a received request; returns true, or nil and what is wrong. A
--- version mismatch is reported as such so that the server can refuse clearly.
---@param message table
---@return boolean|nil ok, string? reason, string? code
function M.check_request(message)
  if message.protocol ~= M.VERSION then
    return nil, string.format("peer speaks protocol %s, this side speaks %d",
      tostring(message.protocol), M.VERSION), "PROTOCOL_MISMATCH"
  end
  if type(message.id) ~= "number" or type(message.cmd) ~= "string" then
    return nil, "request without a numeric id and a string cmd", "BAD_REQUEST"
  end
  if not is_id(message.id) then
    -- (A non-finite id could not even be sent back: the answer would be lost.)
    return nil, string.format("request id %s is not an integer from 0 to 2^53", tostring(message.id)), "BAD_REQUEST"
  end
  if message.payload ~= nil and type(message.payload) ~= "table" then
    return nil, "request payload is not an object", "BAD_REQUEST"
  end
  return true
end

--- Builds the failed response to a message that check_request refused: it
--- echoes the message's id (a numeric string as its number) when that is a
--- valid id, else 0, and its cmd as text (a cmd that is neither a string nor
--- a number as its type's name, not as an address in this process), so that
--- the answer can always be encoded.
---@param message table
---@param code string
---@param reason string
---@param fields table?
function M.refusal(message, code, reason, fields)
  local id = tonumber(message.id)
  local cmd = message.cmd
  cmd = (type(cmd) == "string" or type(cmd) == "number") and tostring(cmd) or type(cmd)
  return M.failure({ id = is_id(id) and id or 0, cmd = cmd }, code, reason, fields)
end

-- The fields of a remote error that wsync.errors reads, and their types: a
-- failed response whose error has another type there could not be reported.
local ERROR_FIELD_TYPES = {
  { "phase", "string" }, { "rank", "number" }, { "file", "string" }, { "line", "number" }, { "traceback", "string" },
}

--- Checks a response against the request it must answer; returns true, or nil
--- and what is wrong (wrong protocol, id, cmd, ok flag, result or error type).
---@param message table
---@param id integer
---@param cmd string
---@return boolean|nil ok, string? reason
function M.check_response(message, id, cmd)
  if message.protocol ~= M.VERSION then
    return nil, string.format("peer speaks protocol %s, this side speaks %d", tostring(message.protocol), M.VERSION)
  end
  if message.id ~= id then
    return nil, string.format("response id %s does not match request id %d", tostring(message.id), id)
  end
  if message.cmd ~= cmd then
    return nil, string.format("response cmd %s does not match request cmd %s", tostring(message.cmd), cmd)
  end
  if message.ok == true then
    if type(message.result) ~= "table" then
      return nil, string.format("result of %s is a %s, not an object", cmd, type(message.result))
    end
  elseif message.ok == false then
    local err = message.error
    if type(err) ~= "table" or type(err.code) ~= "string" or type(err.message) ~= "string" then
      return nil, string.format("failed %s response without an error {code, message}", cmd)
    end
    for _, expected in ipairs(ERROR_FIELD_TYPES) do
      local field, kind = expected[1], expected[2]
      if err[field] ~= nil and type(err[field]) ~= kind then
        return nil, string.format("failed %s response whose error.%s is a %s, not a %s", cmd, field, type(err[field]),
          kind)
      end
    end
  else
    return nil, string.format("response to %s has no boolean ok", cmd)
  end
  return true
end

return M
