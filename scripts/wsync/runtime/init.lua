--- Rollout runtimes the host spawns and drives. `spawn(options)` starts one
--- and returns its client (wsync.control.client) after the handshake; it must
--- be called from a coroutine (the REPL, `wsync run`, and wsync.loop.spawn give
--- one). The reference runtime is built in: `wsync runtime` is its main process;
--- the vllm runtime is a Python process (wsync.runtime.vllm).
local client = require("wsync.control.client")

local M = {}

---@class wsync.RuntimeSpawnOptions
---@field kind "reference"|"vllm"|nil
---@field tp integer?
---@field backend string?
---@field devices integer[]?
---@field weights_bytes integer?
---@field kv_bytes integer?
---@field timeouts table?
---@field grace_ms integer?
---@field fault string?
---@field program string?
---@field env string[]?
---@field output string?  the prefix of its lines, relayed by this process (wsync.output)
---@field on_slow fun(client: wsync.RuntimeClient, cmd: string, seconds: number, deadline: number)?  says what a
---  command waits for (wsync.control.client.spawn)

--- The devices of a runtime's TP workers, in rank order, as its `--devices`
--- argument: options.devices, or 0 .. tp-1.
---@param options wsync.RuntimeSpawnOptions
---@return string
function M.device_list(options)
  local devices = {}
  for rank = 1, options.tp or 1 do
    devices[rank] = tostring(options.devices and options.devices[rank] or (rank - 1))
  end
  return table.concat(devices, ",")
end

-- Spawns a runtime's main process as a client: `fields` (its name, argv,
-- env and timeouts) with what every runtime kind takes alike from `options`.
local function spawn_client(options, fields)
  return client.spawn(require("wsync.util").merged(fields, {
    grace_ms = options.grace_ms,
    output = options.output,
    results = require("wsync.control.messages").from_runtime,
    on_slow = options.on_slow,
  }))
end

--- Spawns a runtime.
--- `env` adds "NAME=value" entries to the runtime's environment; `fault` is
--- a test-only fault spec (wsync.control.fault).
---@param options wsync.RuntimeSpawnOptions
---@return wsync.RuntimeClient
function M.spawn(options)
  options = options or {}
  local kind = options.kind or "reference"
  if kind == "vllm" then
    return require("wsync.runtime.vllm").spawn(options, spawn_client)
  elseif kind ~= "reference" then
    require("wsync.errors").raise("RUNTIME_START", string.format("unknown runtime kind '%s' (this build has: "
      .. "reference, vllm)", tostring(kind)))
  end
  local tp = options.tp or 1
  local program = options.program or require("wsync.util").program()
  -- The host's timeout of each command, which the runtime's main process
  -- shortens for its own hop to the TP workers (client.inner_timeouts).
  local timeouts = require("wsync.control.timeouts").with(options.timeouts)
  return spawn_client(options, {
    name = "reference runtime",
    argv = {
      program, "runtime",
      "--tp", tostring(tp),
      "--backend", options.backend or "host",
      "--devices", M.device_list(options),
      "--weights-bytes", tostring(options.weights_bytes or 1048576),
      "--kv-bytes", tostring(options.kv_bytes or 1048576),
      "--timeouts", require("cjson").encode(timeouts),
    },
    env = (function()
      -- Without options.fault the runtime inherits $WSYNC_RUNTIME_FAULT (tests
      -- set it for a whole `wsync run`).
      local env = options.fault and { "WSYNC_RUNTIME_FAULT=" .. options.fault } or {}
      for _, entry in ipairs(options.env or {}) do
        env[#env + 1] = entry
      end
      return env
    end)(),
    timeouts = timeouts,
  })
end

return M
