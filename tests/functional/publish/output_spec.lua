-- Every process's output as `wsync run` writes it, into a file: whole lines,
-- each child's prefixed with its name (wsync.output), in order per process.
local uv = require("luv")
local process = require("tests.helpers.process")

local function read_lines(path)
  local lines = {}
  local file = assert(io.open(path, "r"))
  local text = file:read("*a")
  file:close()
  assert.are.equal("\n", text:sub(-1), "the file ends with a whole line")
  for line in text:gmatch("([^\n]*)\n") do
    lines[#lines + 1] = line
  end
  return lines
end

-- Runs `command` (a shell command line) with WSYNC set to the binary under
-- test, its output going to a fresh file; returns the result and the file's
-- lines.
local function run_into_file(command, env)
  local directory = assert(uv.fs_mkdtemp((os.getenv("TMPDIR") or "/tmp") .. "/wsync-output-XXXXXX"))
  local path = directory .. "/out"
  local entries = { "WSYNC=" .. process.wsync_binary(), "OUT=" .. path }
  for _, entry in ipairs(env or {}) do
    entries[#entries + 1] = entry
  end
  local result = process.run({ program = "/bin/sh", args = { "-c", command }, env = entries, timeout = 60000 })
  local lines = read_lines(path)
  os.remove(path)
  uv.fs_rmdir(directory)
  return result, lines
end

describe("wsync run's output into a file", function()
  it("is whole lines, the host's and each child's prefixed, each rank's in order", function()
    local result, lines = run_into_file('exec "$WSYNC" run recipes/demo.lua trainer.steps=5 > "$OUT" 2>&1')
    assert.are.equal(0, result.code, result.stderr)
    local next_version = { [0] = 1, [1] = 1 }
    for _, line in ipairs(lines) do
      local rank, rest = line:match("^%[trainer (%d)%] (.*)$")
      if rank then
        rank = tonumber(rank)
        assert.are.equal(string.format("trainer rank %d: published model version %d", rank, next_version[rank]),
          rest:match("^(trainer rank %d: published model version %d+) %(publication %x+%)$"), line)
        next_version[rank] = next_version[rank] + 1
      else
        assert.matches("^wsync: ", line)
      end
    end
    assert.are.same({ [0] = 6, [1] = 6 }, next_version, "every rank's five lines")
    assert.are.equal("wsync: verdict: OK: 5 model versions published, every resident TP slice verified",
      lines[#lines])
  end)

  it("has the runtime's lines prefixed too", function()
    -- (A fault spec the runtime refuses: it says so on stderr and exits.)
    local result, lines = run_into_file('exec "$WSYNC" run recipes/demo.lua > "$OUT" 2>&1',
      { "WSYNC_RUNTIME_FAULT=bogus" })
    assert.are.equal(1, result.code)
    local runtime = {}
    for _, line in ipairs(lines) do
      local rest = line:match("^%[runtime%] (.*)$")
      if rest then
        runtime[#runtime + 1] = rest
      else
        assert.matches("^wsync: ", line:gsub("^%[trainer %d%] ", ""))
      end
    end
    assert.matches("^wsync: .*bad fault spec item 'bogus'", runtime[1] or "", nil, table.concat(lines, "\n"))
  end)
end)

describe("wsync.output", function()
  it("relays whole lines: pieces joined, a long line cut, the last one ended", function()
    local code = [[
      local uv = require("luv")
      local output = require("wsync.output")
      output.MAX_LINE = 100
      local relay = output.new("[child] ")
      -- (The x line comes in pieces, its end apart; the y line in one
      -- write with its end: both are cut.)
      local script = "printf 'one '; sleep 0.1; printf 'line\\ntwo\\n'; printf 'err\\n' >&2; "
        .. "head -c 250 /dev/zero | tr '\\0' x; sleep 0.1; printf '\\n%s\\nlast' $(head -c 250 /dev/zero | tr '\\0' y)"
      local handle = uv.spawn("/bin/sh", { args = { "-c", script }, stdio = { nil, relay.stdout, relay.stderr } },
        function() end)
      relay:start()
      require("wsync.loop").spawn(function()
        assert(output.drain(10), "drained")
        handle:close()
      end)
    ]]
    local result = process.wsync({ "-e", code })
    assert.are.equal(0, result.code, result.stderr)
    assert.are.equal("[child] err\n", result.stderr)
    local function cut(letter)
      return "[child] " .. letter:rep(100) .. "\n[child] " .. letter:rep(100) .. "\n[child] " .. letter:rep(50) .. "\n"
    end
    assert.are.equal("[child] one line\n[child] two\n" .. cut("x") .. cut("y") .. "[child] last\n", result.stdout)
  end)
end)
