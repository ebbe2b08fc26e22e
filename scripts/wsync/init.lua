--- wsync: publish trainer weights into a rollout engine, fail-stop.
---
--- `require("wsync")` gives the version and loads submodules on first use:
--- `wsync.manifest`, `wsync.recipe`, `wsync.repl`, ... each is `wsync.<name>`.
---@class wsync
---@field version string
local M = {}

local core = require("wsync._core")
local host = require("wsync._host")

M.version = core.version

--- Where the Lua scripts came from: the source tree's path, or "embedded".
M.script_source = host.script_root() or "embedded"

--- True when this binary carries the cuda backend (a GPU may still be absent).
M.cuda_built = core.cuda_built

return setmetatable(M, {
  __index = function(self, name)
    if type(name) ~= "string" or name:sub(1, 1) == "_" then
      return nil
    end
    local ok, module = pcall(require, "wsync." .. name)
    if not ok then
      if tostring(module):find("module 'wsync." .. name .. "' not found", 1, true) then
        return nil
      end
      error(module, 2)
    end
    rawset(self, name, module)
    return module
  end,
})
