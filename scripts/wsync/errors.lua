--- Error objects for policy-level failures and their exit codes.
---
--- An error object is a table `{code, message, phase?, rank?, file?, line?,
--- field?, cause?}` with a readable `__tostring`; `wsync.errors.raise` throws one.
local M = {}

---@class wsync.Error
---@field code string      stable upper-case code, e.g. "RECIPE_INVALID"
---@field message string   what failed and what to change
---@field phase string?    publication or command phase
---@field rank integer?    trainer rank or TP rank concerned
---@field file string?     file the error is about
---@field line integer?    line in that file
---@field field string?    dotted path of a recipe field
---@field traceback string? added by the host's message handler
local Error = {}
Error.__index = Error

function Error:__tostring()
  local where = ""
  if self.file then
    where = self.file .. (self.line and (":" .. self.line) or "") .. ": "
  end
  local context = {}
  if self.phase then context[#context + 1] = "phase " .. self.phase end
  if self.rank then context[#context + 1] = "rank " .. self.rank end
  local prefix = #context > 0 and ("[" .. table.concat(context, ", ") .. "] ") or ""
  return where .. prefix .. self.message
end

--- Exit codes of the `wsync` command, by error code. Anything else exits 1.
M.exit_codes = {
  USAGE = 2,
  RECIPE_INVALID = 3,
  SCRIPT_INVALID = 3,
  INTERRUPTED = 130,
}

--- Makes an error object.
---@param code string
---@param message string
---@param fields table?  extra fields (phase, rank, file, line, field, ...)
---@return wsync.Error
function M.new(code, message, fields)
  local err = {}
  for key, value in pairs(fields or {}) do
    err[key] = value
  end
  err.code, err.message = code, message
  return setmetatable(err, Error)
end

--- Raises an error object (never returns).
---@param code string
---@param message string
---@param fields table?
function M.raise(code, message, fields)
  error(M.new(code, message, fields), 0)
end

--- An error's fields as a plain table for a control message: code,
--- message, and every other field that is a string, number or boolean.
---@param err wsync.Error
---@return table
function M.fields(err)
  local fields = {}
  for key, value in pairs(err) do
    local kind = type(value)
    if kind == "string" or kind == "number" or kind == "boolean" then
      fields[key] = value
    end
  end
  return fields
end

--- True when `value` is the sentinel that os.exit raises inside the host to
--- end the process (it must pass every handler untouched).
function M.is_exit(value)
  local meta = type(value) == "table" and getmetatable(value)
  return meta and meta.__name == "wsync exit" or false
end

-- The errors already printed for a person: weak keys, nothing kept alive.
local reported = setmetatable({}, { __mode = "k" })

--- Marks error object `err` as printed already (a run's verdict said it),
--- so that the command line does not print it a second time as it exits.
---@param err any
function M.set_reported(err)
  if type(err) == "table" then
    reported[err] = true
  end
end

--- True when `err` was printed already (M.set_reported).
---@param err any
---@return boolean
function M.was_reported(err)
  return type(err) == "table" and reported[err] == true
end

--- True when `value` is a wsync error object.
function M.is(value)
  return getmetatable(value) == Error
end

--- The process exit code for an error value (object or string).
function M.exit_code(value)
  if M.is(value) then
    return M.exit_codes[value.code] or 1
  end
  if type(value) == "string" and value:match("^interrupted") then
    return M.exit_codes.INTERRUPTED
  end
  return 1
end

--- Text for a person: the message, then the traceback when `verbose` is set.
function M.format(value, verbose)
  local text = tostring(value)
  if type(value) == "table" and value.traceback and verbose then
    text = text .. "\n" .. value.traceback
  end
  return text
end

return M
