--- The token of a recipe's TCP control endpoint, when the recipe says where
--- it is (control.token_env, control.token_file): read where it says, and
--- refused when it is missing or too weak to travel in an endpoint's URL.
--- The host draws one where the recipe gives none (wsync.control.endpoint).
local util = require("wsync.util")

local M = {}

--- The shortest token a recipe may give its TCP endpoint, in characters.
M.MIN_TOKEN = 16

--- The token of a recipe's TCP control endpoint when the recipe says where
--- it is (`control.token_env`: an environment variable, `control.token_file`:
--- a file, relative to the working directory, its whitespace around it
--- ignored), and where that is ("$NAME", "the file PATH"); nil when it gives
--- none (the host draws one). Nil, a message and the field when the token
--- is not there, or shorter than M.MIN_TOKEN, or has characters other than
--- letters, digits and `-._~` (it travels in an endpoint's URL).
---@param recipe table  validated
---@return string? token, string where_or_message, string? field
function M.control_token(recipe)
  local control = recipe.control or {}
  local token, where, field
  if control.token_env then
    field, where = "control.token_env", "$" .. control.token_env
    token = os.getenv(control.token_env)
    if token == nil or token == "" then
      return nil, string.format("the environment variable %s, which holds the TCP endpoint's token, is not set",
        control.token_env), field
    end
  elseif control.token_file then
    field, where = "control.token_file", "the file " .. control.token_file
    local text, message = util.read_file(control.token_file)
    if not text then
      return nil, string.format("cannot read the TCP endpoint's token from %s: %s", control.token_file,
        tostring(message)), field
    end
    token = text:match("^%s*(.-)%s*$")
  else
    return nil, nil
  end
  if #token < M.MIN_TOKEN or not token:match("^[%w%-%._~]+$") then
    return nil, string.format("the token in %s must be at least %d characters of letters, digits and -._~ (it has "
      .. "%d); e.g. openssl rand -hex 16", where, M.MIN_TOKEN, #token), field
  end
  return token, where
end

return M
