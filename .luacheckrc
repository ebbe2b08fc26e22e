-- luacheck's rules for wsync's Lua (STYLE.md: "luacheck passes"). CTest's
-- `lint` test runs `luacheck scripts recipes tests` from the repository root
-- and fails on any warning; run the same by hand to see them.

-- The host embeds LuaJIT: Lua 5.1 plus bit, ffi, jit, table.new and the rest.
std = "luajit"

-- The code wraps at 120 columns, comments and strings included. A LuaCATS
-- annotation too long for one line names a `---@class` instead.
max_line_length = 120

-- A method keeps the `obj:method()` shape of its class even when it does not
-- read the object (Inflight:await): an unused implicit `self` is not a defect.
-- An explicit unused argument is still reported; name it `_` or `_name`.
self = false

-- Privates are `_name` fields and methods (STYLE.md); luacheck checks no field
-- names, so they need no rule. A `_`-prefixed local or argument is luacheck's
-- "unused on purpose" hint: it is reported if it is used after all (214).

-- Specs, the helpers they load (tests/helpers/preload.lua registers hooks) and
-- the fixture specs run under busted, which defines describe, it, assert, ...
files["tests"] = { std = "luajit+busted" }

-- Recipes run in the restricted environment of wsync.recipe (M.environment in
-- scripts/wsync/recipe/load.lua): the safe globals, copies of math, string and
-- table, four functions of os, `require` for wsync modules and `extends`. Keep
-- this list in step with that one: luacheck then refuses what the loader would.
stds.recipe = {
  read_globals = {
    "assert", "error", "ipairs", "next", "pairs", "pcall", "print", "rawequal",
    "rawget", "select", "tonumber", "tostring", "type", "unpack", "xpcall",
    "math", "string", "table", "require", "extends",
    os = { fields = { "getenv", "time", "clock", "date" } },
  },
}
files["recipes"] = { std = "recipe" }
files["tests/fixtures/recipes"] = { std = "recipe" }

-- Fixtures broken on purpose, each in the one way its test expects (the line
-- marked "-- bad"): only that warning is allowed, and a file that cannot be
-- parsed at all is not checked.
files["tests/fixtures/recipes/sets_global.lua"].ignore = { "111" }
files["tests/fixtures/recipes/reads_undefined.lua"].ignore = { "113" }
exclude_files = { "tests/fixtures/recipes/syntax_error.lua" }
