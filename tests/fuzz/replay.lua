--- Replays fuzz inputs through the fuzz entry without the fuzzer:
--- `wsync tests/fuzz/replay.lua FILE...` (from the repository root) runs each
--- file's bytes as one input and prints "ok FILE" or the finding.
--- Exits 1 when any input is a finding.
local entry = require("tests.fuzz.entry")

local failures = 0
for _, path in ipairs(arg) do
  local file = assert(io.open(path, "rb"))
  local input = file:read("*a")
  file:close()
  local ok, err = pcall(entry.run, input)
  if ok then
    print("ok " .. path)
  else
    failures = failures + 1
    print("FINDING " .. path .. ": " .. tostring(err))
  end
end
entry.cleanup()
if failures > 0 then
  os.exit(1)
end
