-- Benchmark: control round-trip latency between the host and the reference
-- runtime over the control protocol, host backend.
--
--   wsync tests/bench/control_rtt.lua [REQUESTS]      (default 10000)
--
-- Measures, in one run: (1) a raw luv ping-pong of one byte between two
-- processes (the floor: process wake-ups and pipe I/O only); (2) `info`
-- requests to a TP2 reference runtime with wsync's defaults (adaptive
-- busy-polling after a request and after an answer); (3) the same with the
-- busy-polling turned off; (4) the floor again. Prints p50, p99, mean and max in microseconds and
-- the ratio of (2)'s p50 to the target (100 us).
local uv = require("luv")
local loop = require("wsync.loop")
local runtime = require("wsync.runtime")
local client = require("wsync.control.client")

local requests = tonumber(arg and arg[1]) or 10000
local TARGET_P50_US = 100

local function summarize(samples)
  table.sort(samples)
  local sum = 0
  for _, value in ipairs(samples) do
    sum = sum + value
  end
  local function at(fraction)
    return samples[math.max(1, math.floor(#samples * fraction + 0.5))]
  end
  return { p50 = at(0.50), p99 = at(0.99), mean = sum / #samples, max = samples[#samples], n = #samples }
end

local function report(label, stats)
  print(string.format("%-44s n=%-6d p50 %7.1f us  p99 %7.1f us  mean %7.1f us  max %8.1f us", label, stats.n,
    stats.p50, stats.p99, stats.mean, stats.max))
end

-- (1) raw ping-pong floor through a child running a one-line echo.
local function raw_floor(count)
  local pipe = uv.new_pipe(false)
  local echo = "local uv=require('luv') local p=uv.new_pipe(false) p:open(3) "
    .. "p:read_start(function(e,d) if not d then p:close() return end p:write(d) end)"
  local handle
  handle = uv.spawn(uv.exepath(), { args = { "-e", echo }, stdio = { nil, 1, 2, pipe } }, function()
    handle:close()
  end)
  local samples, started = {}, 0
  loop.await(function(resume)
    pipe:read_start(function(_, data)
      if not data then
        return
      end
      samples[#samples + 1] = (uv.hrtime() - started) / 1000
      if #samples < count then
        started = uv.hrtime()
        pipe:write("x")
      else
        pipe:read_stop()
        pipe:close()
        resume()
      end
    end)
    started = uv.hrtime()
    pipe:write("x")
  end)
  return summarize(samples)
end

local function info_round_trips(count, spin)
  local saved = client.SPIN_MICROSECONDS
  client.SPIN_MICROSECONDS = spin and saved or 0
  local rt = runtime.spawn({ tp = 2, env = spin and {} or { "WSYNC_SERVER_SPIN_US=0" } })
  for _ = 1, 200 do -- warm up
    rt:request("info")
  end
  local samples = {}
  for i = 1, count do
    local started = uv.hrtime()
    rt:request("info")
    samples[i] = (uv.hrtime() - started) / 1000
  end
  assert(rt:close())
  client.SPIN_MICROSECONDS = saved
  return summarize(samples)
end

loop.spawn(function()
  print(string.format("control round trip, %d requests each, %d CPUs", requests, #uv.cpu_info()))
  local floor = raw_floor(requests)
  report("raw 1-byte ping-pong (floor)", floor)
  local default = info_round_trips(requests, true)
  report("info, TP2 reference runtime (default)", default)
  local idle = info_round_trips(requests, false)
  report("info, TP2 reference runtime (no busy-poll)", idle)
  -- The hypervisor's halt polling warms up with frequent wake-ups: measure the
  -- floor again last, so that the order of the runs is visible.
  local floor_after = raw_floor(requests)
  report("raw 1-byte ping-pong (floor, again)", floor_after)
  print(string.format("p50 / target (%d us): %.2f   p50 / raw floor (best of two): %.2f   "
    .. "no-busy-poll p50 / default p50: %.2f", TARGET_P50_US, default.p50 / TARGET_P50_US,
    default.p50 / math.min(floor.p50, floor_after.p50), idle.p50 / default.p50))
end, function(ok, err)
  if not ok then
    io.stderr:write(tostring(err), "\n", err.traceback or "", "\n")
    os.exit(1)
  end
end)
loop.run()
