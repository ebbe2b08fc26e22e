-- The `wsync` command line: help, version, usage errors, -e chunks and Lua
-- files, checked by running the binary.
local uv = require("luv")
local process = require("tests.helpers.process")

local function project_version()
  local file = assert(io.open("CMakeLists.txt"))
  local version = file:read("*a"):match("project%(wsync VERSION ([%d%.]+)")
  file:close()
  return version
end

-- A temporary directory with the given files ({name = source}); returns its
-- path and a function that removes it.
local function scratch(files)
  local directory = assert(uv.fs_mkdtemp("/tmp/wsync-cli-XXXXXX"))
  for name, source in pairs(files) do
    local file = assert(io.open(directory .. "/" .. name, "w"))
    file:write(source)
    file:close()
  end
  return directory, function()
    for name in pairs(files) do
      assert(os.remove(directory .. "/" .. name))
    end
    assert(uv.fs_rmdir(directory))
  end
end

describe("wsync --version and --help", function()
  it("prints the version, the commit, the build type and whether CUDA and NCCL are built in", function()
    local cuda = require("wsync._core").cuda_built
    for _, flag in ipairs({ "--version", "-v" }) do
      local result = process.wsync({ flag })
      assert.are.equal(0, result.code, result.stderr)
      assert.are.equal("", result.stderr)
      local lines = {}
      for line in result.stdout:gmatch("([^\n]*)\n") do
        lines[#lines + 1] = line
      end
      assert.are.equal(5, #lines, result.stdout)
      assert.are.equal("wsync " .. project_version(), lines[1])
      -- (Built from this checkout: one of its commits, with "-dirty" when
      -- files differed from it then; "unknown" outside a checkout.)
      local git = uv.fs_access("/usr/bin/git", "X") and process.run({ program = "/usr/bin/git",
        args = { "rev-parse", "--show-toplevel" } })
      if git and git.code == 0 then
        local commit = lines[2]:match("^commit  (%x+)$") or lines[2]:match("^commit  (%x+)%-dirty$")
        assert.is_not_nil(commit, lines[2])
        assert.are.equal(12, #commit)
        local known = process.run({ program = "/usr/bin/git", args = { "cat-file", "-e", commit .. "^{commit}" } })
        assert.are.equal(0, known.code, "git does not know commit " .. commit .. ": " .. known.stderr)
      else
        assert.are.equal("commit  unknown", lines[2])
      end
      assert.matches("^build   %a+$", lines[3])
      assert.matches(cuda and "^cuda    built in %(CUDA toolkit [%d.]+;" or "^cuda    not built in", lines[4])
      assert.matches(cuda and "^nccl    built in" or "^nccl    not built in", lines[5])
    end
  end)

  it("prints help naming every command and the exit codes", function()
    local result = process.wsync({ "--help" })
    assert.are.equal(0, result.code, result.stderr)
    assert.are.equal("", result.stderr)
    for _, command in ipairs({ "wsync FILE.lua", "wsync -e CODE", "wsync run RECIPE", "wsync check RECIPE",
      "--json", "wsync repl", "wsync test", "wsync --version", "wsync --help", "WSYNC_SCRIPTS" }) do
      assert.matches(command, result.stdout, 1, true)
    end
    assert.matches("exit codes:", result.stdout, 1, true)
    for _, code in ipairs({ "0", "1", "2", "3", "130" }) do
      assert.matches("\n  " .. code .. " +%S", result.stdout)
    end
    assert.are.equal(result.stdout, process.wsync({ "-h" }).stdout)
    assert.are.equal(result.stdout, process.wsync({ "help" }).stdout)
    -- (A command's --help is the same help, not a recipe named --help.)
    for _, words in ipairs({ { "run", "--help" }, { "check", "-h" }, { "repl", "--help" } }) do
      local asked = process.wsync(words)
      assert.are.equal(0, asked.code, table.concat(words, " ") .. ": " .. asked.stderr)
      assert.are.equal(result.stdout, asked.stdout, table.concat(words, " "))
    end
  end)
end)

describe("wsync usage errors", function()
  it("prints usage on stderr and exits 2 without arguments", function()
    local result = process.wsync({})
    assert.are.equal(2, result.code)
    assert.are.equal("", result.stdout)
    assert.matches("^usage: wsync ", result.stderr)
    assert.are.equal(process.wsync({ "--help" }).stdout, result.stderr)
  end)

  it("exits 2 on an unknown command or option, naming it", function()
    local result = process.wsync({ "frobnicate" })
    assert.are.equal(2, result.code)
    assert.are.equal("wsync: unknown command 'frobnicate' (see wsync --help)\n", result.stderr)
    result = process.wsync({ "--frobnicate" })
    assert.are.equal(2, result.code)
    assert.are.equal("wsync: unknown option '--frobnicate' (see wsync --help)\n", result.stderr)
  end)

  it("exits 2 when -e has no chunk", function()
    local result = process.wsync({ "-e" })
    assert.are.equal(2, result.code)
    assert.matches("-e needs a chunk of Lua", result.stderr, 1, true)
  end)
end)

describe("wsync -e", function()
  it("prints the version through require('wsync')", function()
    local result = process.wsync({ "-e", 'print(require("wsync").version)' })
    assert.are.equal(0, result.code, result.stderr)
    assert.are.equal(project_version() .. "\n", result.stdout)
  end)

  it("passes the remaining words as the chunk's arguments", function()
    local result = process.wsync({ "-e", "print(select('#', ...), ...)", "one", "two words" })
    assert.are.equal(0, result.code, result.stderr)
    assert.are.equal("2\tone\ttwo words\n", result.stdout)
  end)

  it("runs the loop until the chunk's waits are done", function()
    local result = process.wsync({ "-e", 'require("wsync.loop").sleep(20) print("after sleep")' })
    assert.are.equal(0, result.code, result.stderr)
    assert.are.equal("after sleep\n", result.stdout)
  end)

  it("exits 1 on an error, naming (command line):1: with a traceback", function()
    local result = process.wsync({ "-e", 'error("boom")' })
    assert.are.equal(1, result.code)
    assert.are.equal("", result.stdout)
    assert.matches("^wsync: %(command line%):1: boom\nstack traceback:\n", result.stderr)
  end)

  it("names the failing line of a longer chunk, after its earlier output", function()
    local result = process.wsync({ "-e", 'print("before")\nerror("boom")' })
    assert.are.equal(1, result.code)
    assert.are.equal("before\n", result.stdout)
    assert.matches("^wsync: %(command line%):2: boom\n", result.stderr)
    assert.matches("stack traceback:", result.stderr, 1, true)
  end)

  it("exits 3 on a syntax error, naming (command line):1:", function()
    local result = process.wsync({ "-e", "x = = 1" })
    assert.are.equal(3, result.code)
    assert.matches("^wsync: %(command line%):1: unexpected symbol near '='", result.stderr)
    assert.are.equal("", result.stdout)
  end)

  it("exits with the code given to os.exit, after the output", function()
    local result = process.wsync({ "-e", 'io.write("partial") os.exit(4)' })
    assert.are.equal(4, result.code)
    assert.are.equal("partial", result.stdout)
    assert.are.equal("", result.stderr)
    assert.are.equal(0, process.wsync({ "-e", "os.exit(true)" }).code)
    assert.are.equal(1, process.wsync({ "-e", "os.exit(false)" }).code)
    assert.are.equal(5, process.wsync({ "-e", 'require("wsync.loop").sleep(5) os.exit(5)' }).code)
  end)
end)

describe("wsync FILE.lua", function()
  local directory, cleanup
  before_each(function()
    directory, cleanup = scratch({
      ["args.lua"] = 'print(arg[0], arg[1], arg[2], arg[3], select("#", ...), ...)\n',
      ["syntax.lua"] = "local ok = true\nlocal broken = (\nreturn ok\n",
      ["fails.lua"] = 'local x = 1\nerror("failed on purpose")\n',
      ["exits.lua"] = 'print("before exit")\nos.exit(3)\nprint("after exit")\n',
      ["waits.lua"] = 'local loop = require("wsync.loop")\nloop.sleep(5)\nos.exit(6)\n',
    })
  end)
  after_each(function()
    cleanup()
  end)

  it("runs the file with arg[0] and its arguments", function()
    local path = directory .. "/args.lua"
    local result = process.wsync({ path, "a", "b c" })
    assert.are.equal(0, result.code, result.stderr)
    assert.are.equal(path .. "\ta\tb c\tnil\t2\ta\tb c\n", result.stdout)
  end)

  it("exits 3 on a syntax error, naming file:line", function()
    local path = directory .. "/syntax.lua"
    local result = process.wsync({ path })
    assert.are.equal(3, result.code)
    assert.matches("^wsync: " .. path:gsub("%p", "%%%0") .. ":3: ", result.stderr)
  end)

  it("exits 1 on a runtime error, naming file:line", function()
    local path = directory .. "/fails.lua"
    local result = process.wsync({ path })
    assert.are.equal(1, result.code)
    assert.matches("wsync: " .. path .. ":2: failed on purpose", result.stderr, 1, true)
  end)

  it("exits with os.exit's code, before later statements", function()
    local result = process.wsync({ directory .. "/exits.lua" })
    assert.are.equal(3, result.code, result.stderr)
    assert.are.equal("before exit\n", result.stdout)
    assert.are.equal("", result.stderr)
    assert.are.equal(6, process.wsync({ directory .. "/waits.lua" }).code)
  end)

  it("exits 3 when the file does not exist", function()
    local result = process.wsync({ directory .. "/missing.lua" })
    assert.are.equal(3, result.code)
    assert.matches("cannot open " .. directory .. "/missing.lua", result.stderr, 1, true)
  end)
end)

describe("wsync run and check of a recipe file that does not exist", function()
  it("exit 3 naming the file and why, with no line number", function()
    for _, command in ipairs({ "run", "check" }) do
      local result = process.wsync({ command, "tests/fixtures/recipes/missing.lua" })
      assert.are.equal(3, result.code)
      assert.are.equal("wsync: tests/fixtures/recipes/missing.lua: cannot open the recipe: No such file or "
        .. "directory\n", result.stderr)
    end
  end)
end)
