--- wsync: publish trainer weights into a rollout engine, fail-stop.
---
--- `require("wsync")` gives the version and loads submodules on first use:
--- `wsync.native.manifest`, `wsync.recipe`, `wsync.cli.repl`, ... each is `wsync.<name>`.
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

--- What this binary is, as `wsync --version`, `--json` outputs and run
--- reports name it: the version, the commit it was built from ("-dirty" when
--- files differed from it, "unknown" outside a git checkout), CMake's build
--- type, whether it carries the cuda backend (and the CUDA toolkit it was
--- built with; null without) and NCCL's path (NCCL is loaded at run time).
---@type {version: string, commit: string, build_type: string, cuda: boolean, cuda_toolkit: any, nccl: boolean}
M.build = {
  version = core.version, commit = core.commit, build_type = core.build_type, cuda = core.cuda_built,
  cuda_toolkit = core.cuda_version or require("cjson").null, nccl = core.nccl_built,
}

--- The folders of wsync's modules (shared/DESIGN.md section 2). One that has
--- no init.lua of its own is a namespace: `wsync.publish.session` loads
--- `wsync.publish.session` on first use.
M.FOLDERS = {
  cli = true, control = true, native = true, plan = true, publish = true, recipe = true, runtime = true,
  trainer = true, transport = true,
}

-- A table whose fields load the modules under `prefix` on first use.
local function namespace(prefix, folders)
  return setmetatable({}, {
    __index = function(self, name)
      if type(name) ~= "string" or name:sub(1, 1) == "_" then
        return nil
      end
      local full = prefix .. "." .. name
      local ok, module = pcall(require, full)
      if not ok then
        if not tostring(module):find("module '" .. full .. "' not found", 1, true) then
          error(module, 2)
        end
        if not (folders and folders[name]) then
          return nil
        end
        module = namespace(full)
      end
      rawset(self, name, module)
      return module
    end,
  })
end

return setmetatable(M, getmetatable(namespace("wsync", M.FOLDERS)))
