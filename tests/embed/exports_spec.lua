-- libwsync exports only the API of bindings/wsync.h: the dynamic symbol table
-- (`nm -D --defined-only`) holds exactly the functions that the header
-- declares. The build's version script comes from the same header through
-- scripts/build/core_api.lua; this spec reads the header its own way, so a
-- declaration the build's reading missed shows up as missing here.
--
-- The library's path comes from $WSYNC_LIBWSYNC, which CTest's embed tier
-- sets.
local HEADER = "bindings/wsync.h"

local function library()
  local path = os.getenv("WSYNC_LIBWSYNC")
  assert(path ~= nil and path ~= "", "WSYNC_LIBWSYNC is not set: run this spec through CTest (ctest --test-dir "
    .. "build -R embed), or set it to the build's libwsync.so")
  return path
end

-- The functions wsync.h declares: a line at column 0 that is not a comment, a
-- preprocessor line or a typedef, and names `ws_...(`.
local function declared_functions()
  local names = {}
  for line in io.lines(HEADER) do
    if not line:match("^[%s/#}]") and not line:match("^typedef") and not line:match("^extern") then
      local name = line:match("[%s%*](ws_[%w_]+)%s*%(")
      if name then
        names[#names + 1] = name
      end
    end
  end
  table.sort(names)
  return names
end

-- The defined symbols of the library's dynamic symbol table, and nm's text.
local function exported_symbols(path)
  local pipe = assert(io.popen("nm -D --defined-only '" .. path .. "' 2>&1"))
  local text = pipe:read("*a")
  local ok, _, code = pipe:close()
  assert(ok == true or ok == 0, string.format("nm -D --defined-only %s failed (%s):\n%s", path, tostring(code), text))
  local names = {}
  for name in text:gmatch("%x*%s+%a%s+([^%s@]+)[^\n]*\n") do
    names[#names + 1] = name
  end
  table.sort(names)
  return names, text
end

-- Names in `a` that are not in `b`.
local function without(a, b)
  local set, rest = {}, {}
  for _, name in ipairs(b) do
    set[name] = true
  end
  for _, name in ipairs(a) do
    if not set[name] then
      rest[#rest + 1] = name
    end
  end
  return rest
end

describe("libwsync's exports", function()
  it("reads a dozen functions from wsync.h, ws_host_open and ws_last_error among them", function()
    local names = declared_functions()
    assert.is_true(#names >= 12, "only " .. #names .. " functions read from " .. HEADER)
    assert.are.same({}, without({ "ws_host_open", "ws_host_close", "ws_last_error", "ws_agent_open" }, names))
  end)

  it("are the functions of wsync.h, no more and no fewer", function()
    local declared = declared_functions()
    local exported, text = exported_symbols(library())
    local extra, missing = without(exported, declared), without(declared, exported)
    assert.are.same({ extra = {}, missing = {} }, { extra = extra, missing = missing },
      "nm -D --defined-only " .. library() .. ":\n" .. text)
  end)
end)
