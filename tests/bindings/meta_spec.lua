-- The LuaCATS stubs of the C modules (bindings/meta/): one file per module,
-- `bindings/meta/_<name>.lua` for `wsync._<name>`, with a `function` stub for
-- every function the module registers and every method of the userdata
-- metatables it creates, and a `---@field` for its other fields.
--
-- The modules are the host's preloaded `wsync._*` entries, so a module added
-- to the host asks for its stub file here without this spec changing.
--
-- Conventions the check relies on (bindings/meta/_shm.lua shows them): the
-- module table is `---@class wsync._<name>` bound to a `local` right after;
-- functions are `function module.name(` and methods `function Class:name(`;
-- a userdata class is named after its metatable, compared ignoring case and
-- underscores inside a name (metatable wsync.manifest_segment: class
-- wsync.ManifestSegment), and has the stubs of the class it extends
-- (`---@class wsync.cuda.Buffer: wsync.cuda.Memory`) as well as its own.
local uv = require("luv")

local META = "bindings/meta"

-- Class names as the check compares them: lowercase, without the underscores
-- inside a name ("wsync._shm" keeps the one that marks a C module).
local function class_key(name)
  return (name:lower():gsub("([^.])_", "%1"))
end

-- The stubs of one file: {[class key] = {name = declared name, functions =
-- {[".f" or ":m"] = true}, fields = {[name] = true}, parent = class key?}}.
-- Raises on a function stub on a local that no `---@class` named.
local function read_stubs(path)
  local file = assert(io.open(path))
  local classes, class_of_local = {}, {}
  local pending, documented = nil, nil
  local number = 0
  for line in file:lines() do
    number = number + 1
    local class = line:match("^%-%-%-@class%s+([%w_.]+)")
    if class then
      local key = class_key(class)
      local parent = line:match("^%-%-%-@class%s+[%w_.]+%s*:%s*([%w_.]+)")
      classes[key] = classes[key] or { name = class, functions = {}, fields = {} }
      classes[key].parent = parent and class_key(parent)
      pending, documented = key, key
    elseif line:match("^%-%-%-") then
      local field = line:match("^%-%-%-@field%s+([%w_]+)")
      if field and documented then
        classes[documented].fields[field] = true
      end
    else
      documented = nil
      local name = line:match("^local%s+([%w_]+)%s*=%s*{}")
      if name and pending then
        class_of_local[name] = pending
        pending = nil
      end
      local owner, separator, method = line:match("^function%s+([%w_]+)([.:])([%w_]+)%s*%(")
      if owner then
        local key = class_of_local[owner]
        if not key then
          file:close()
          error(string.format("%s:%d: function %s%s%s: `%s` is no `local` right after a ---@class", path, number,
            owner, separator, method, owner))
        end
        classes[key].functions[separator .. method] = true
      end
    end
  end
  file:close()
  return classes
end

-- Whether `class` of `stubs` (or a class it extends) has stub `name`.
local function has_stub(stubs, class, name)
  while class do
    if class.functions[name] then
      return true
    end
    class = class.parent and stubs[class.parent]
  end
  return false
end

-- What the module `name` registers: {functions = {name...}, fields = {name...},
-- classes = {[metatable name] = {method...}}}. Opens the module again from
-- package.preload: a metatable it creates or whose methods it registers anew
-- (ws_lua_new_class gives every open a new __index table) is one of its own.
local function inventory(name)
  local registry = debug.getregistry()
  local methods_before = {}
  for key, value in pairs(registry) do
    if type(key) == "string" and type(value) == "table" then
      methods_before[key] = rawget(value, "__index") or false
    end
  end
  local module = package.preload[name](name)
  local result = { functions = {}, fields = {}, classes = {} }
  for key, value in pairs(module) do
    local list = type(value) == "function" and result.functions or result.fields
    list[#list + 1] = key
  end
  for key, value in pairs(registry) do
    if type(key) == "string" and type(value) == "table" and type(rawget(value, "__name")) == "string" then
      local methods = rawget(value, "__index")
      if type(methods) == "table" and methods_before[key] ~= methods then
        local list = {}
        for method, function_value in pairs(methods) do
          if type(function_value) == "function" then
            list[#list + 1] = method
          end
        end
        result.classes[rawget(value, "__name")] = list
      end
    end
  end
  return result
end

-- The C modules the host preloads, sorted.
local function c_modules()
  local names = {}
  for name in pairs(package.preload) do
    if name:match("^wsync%._[%w_]+$") then
      names[#names + 1] = name
    end
  end
  table.sort(names)
  return names
end

local function stub_path(module)
  return string.format("%s/%s.lua", META, module:match("^wsync%.(_[%w_]+)$"))
end

-- Every missing stub of `module` as a line of text (empty when none).
local function missing_stubs(module)
  local path = stub_path(module)
  if not uv.fs_stat(path) then
    return { string.format("no stub file %s (a ---@meta file with ---@class %s)", path, module) }
  end
  local stubs = read_stubs(path)
  local registered = inventory(module)
  local missing = {}
  local own = stubs[class_key(module)]
  if not own then
    missing[#missing + 1] = string.format("%s: no ---@class %s for the module table", path, module)
    own = { functions = {}, fields = {} }
  end
  for _, name in ipairs(registered.functions) do
    if not own.functions["." .. name] then
      missing[#missing + 1] = string.format("%s: no stub `function %s.%s(...) end`", path, module, name)
    end
  end
  for _, name in ipairs(registered.fields) do
    if not own.fields[name] then
      missing[#missing + 1] = string.format("%s: no `---@field %s` in ---@class %s", path, name, module)
    end
  end
  for metatable, methods in pairs(registered.classes) do
    local class = stubs[class_key(metatable)]
    if not class then
      missing[#missing + 1] = string.format("%s: no ---@class for the userdata of metatable %s", path, metatable)
    else
      for _, method in ipairs(methods) do
        if not has_stub(stubs, class, ":" .. method) then
          missing[#missing + 1] = string.format("%s: no stub `function %s:%s(...) end` (metatable %s)", path,
            class.name, method, metatable)
        end
      end
    end
  end
  table.sort(missing)
  return missing
end

describe("the stubs in bindings/meta", function()
  it("finds the C modules the host preloads", function()
    local found = {}
    for _, name in ipairs(c_modules()) do
      found[name] = true
    end
    for _, name in ipairs({ "wsync._core", "wsync._host", "wsync._manifest", "wsync._shm", "wsync._device",
      "wsync._process", "wsync._socket" }) do
      assert.is_true(found[name], name .. " is not among the preloaded modules")
    end
  end)

  for _, module in ipairs(c_modules()) do
    it("has a stub for everything " .. module .. " registers", function()
      local missing = missing_stubs(module)
      assert.are.same({}, missing, module .. ":\n  " .. table.concat(missing, "\n  "))
    end)
  end

  it("holds one file per C module and nothing else", function()
    local modules = {}
    for _, name in ipairs(c_modules()) do
      modules[stub_path(name)] = true
    end
    local strays = {}
    local scan = assert(uv.fs_scandir(META))
    while true do
      local name = uv.fs_scandir_next(scan)
      if not name then
        break
      end
      local path = META .. "/" .. name
      if not modules[path] then
        strays[#strays + 1] = path
      end
    end
    table.sort(strays)
    assert.are.same({}, strays, "files in " .. META .. " that are not _<name>.lua of a C module wsync._<name>")
  end)

  -- The stubs of a stub file holding `text`, written to a temporary file
  -- that the test removes (and its path, to write again).
  local function stubs_of(text)
    local path = os.tmpname()
    finally(function()
      os.remove(path)
    end)
    local file = assert(io.open(path, "w"))
    file:write(text)
    file:close()
    return read_stubs(path), path
  end

  it("finds a method stub on the class that a class extends", function()
    local stubs = stubs_of("---@class wsync.Base\nlocal Base = {}\nfunction Base:shared() end\n"
      .. "---@class wsync.Derived: wsync.Base\nlocal Derived = {}\nfunction Derived:own() end\n")
    local derived = stubs[class_key("wsync.Derived")]
    assert.are.equal(class_key("wsync.Base"), derived.parent)
    assert.is_true(has_stub(stubs, derived, ":own") and has_stub(stubs, derived, ":shared"))
    assert.is_false(has_stub(stubs, stubs[class_key("wsync.Base")], ":own"))
  end)

  it("reports a missing stub, a missing field and an unknown local", function()
    local stubs, path = stubs_of("---@class wsync._socket\nlocal socket = {}\nfunction socket.peer(fd) end\n"
      .. "---@class wsync.Other\nlocal Other = {}\nfunction Other:method() end\n")
    assert.is_true(stubs[class_key("wsync._socket")].functions[".peer"])
    assert.is_nil(stubs[class_key("wsync._socket")].functions[".own_uid"])
    assert.is_true(stubs[class_key("wsync.other")].functions[":method"])
    local file = assert(io.open(path, "w"))
    file:write("local loose = {}\nfunction loose.f() end\n")
    file:close()
    assert.has_error(function()
      read_stubs(path)
    end)
    assert.are.same({ "wsync.manifestsegment", "wsync._shm", "wsync.cuda.copyplan" },
      { class_key("wsync.ManifestSegment"), class_key("wsync._shm"), class_key("wsync.cuda.copy_plan") })
  end)
end)
