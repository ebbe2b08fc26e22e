--- busted `--helper` for every tier (the repository's .busted names it, so
--- CTest's tiers and a plain `wsync test tests/<tier>` from the root load it):
--- after each test, once the test's own after_each blocks have run, it checks
--- that the test left
---   - no libuv handle active and not closing, other than those wsync.loop
---     keeps for itself (`loop.owns`) and those active when the test began
---     (a describe's setup may keep one for all its tests);
---   - no /dev/shm segment named for this process ("wsync-<pid>-...") that
---     was not there when the test began;
---   - the working directory it began in.
--- A test that left something fails (busted reports an error in after_each)
--- with a message naming the test and what it left. What it left is then
--- ended (handles closed, a child process killed first; segments unlinked;
--- the directory changed back), so that the tests after it start clean.
--- When a spec file ends, the same checks run against the state before the
--- file began: what a setup opened its teardown must close.
local uv = require("luv")
local busted = require("busted")
local loop = require("wsync.loop")
local shm_files = require("tests.helpers.shm")

local M = {}

-- Active handles of the loop (not closing, not wsync.loop's own), as a set.
local function active_handles()
  local handles = {}
  uv.walk(function(handle)
    if handle:is_active() and not handle:is_closing() and not loop.owns(handle) then
      handles[handle] = true
    end
  end)
  return handles
end

-- This process's /dev/shm segments, as a set of names.
local function own_segments()
  local names = {}
  for _, name in ipairs(shm_files.segments()) do
    names[name] = true
  end
  return names
end

--- What the process holds now: `{handles, segments, cwd}`.
function M.snapshot()
  return { handles = active_handles(), segments = own_segments(), cwd = uv.cwd() }
end

local function describe_handle(handle)
  local text = tostring(handle)
  if handle:get_type() == "process" then
    text = text .. " pid " .. tostring(handle:get_pid())
  end
  if not handle:has_ref() then
    text = text .. " (unref'd)"
  end
  return text
end

--- What was added since `before` (a snapshot), described and then ended.
--- Returns a list of descriptions, empty when nothing was left.
---@param before {handles: table, segments: table, cwd: string}
---@return string[]
function M.collect_leftovers(before)
  local found = {}
  local handles = {}
  for handle in pairs(active_handles()) do
    if not before.handles[handle] then
      handles[#handles + 1] = handle
    end
  end
  if #handles > 0 then
    local described = {}
    for _, handle in ipairs(handles) do
      described[#described + 1] = describe_handle(handle)
    end
    table.sort(described)
    found[#found + 1] = string.format("%d libuv handle%s active: %s", #handles, #handles == 1 and "" or "s",
      table.concat(described, ", "))
    -- A child is killed and its exit awaited before its handle closes: libuv
    -- reaps only through an open process handle, so no zombie is left.
    local children = {}
    for _, handle in ipairs(handles) do
      if handle:get_type() == "process" then
        handle:kill("sigkill")
        children[#children + 1] = handle
      end
    end
    local deadline = uv.hrtime() + 2e9
    local function waiting()
      for _, child in ipairs(children) do
        if child:is_active() and not child:is_closing() then
          return true
        end
      end
      return false
    end
    while waiting() and uv.hrtime() < deadline do
      uv.run("nowait")
      uv.sleep(1)
    end
    for _, handle in ipairs(handles) do
      if not handle:is_closing() then
        handle:close()
      end
    end
    uv.run("nowait") -- completes the closes
  end
  local segments = {}
  for name in pairs(own_segments()) do
    if not before.segments[name] then
      segments[#segments + 1] = name
      uv.fs_unlink(shm_files.directory .. "/" .. name)
    end
  end
  if #segments > 0 then
    table.sort(segments)
    found[#found + 1] = string.format("%d shared-memory segment%s: %s/%s", #segments, #segments == 1 and "" or "s",
      shm_files.directory, table.concat(segments, ", " .. shm_files.directory .. "/"))
  end
  local cwd = uv.cwd()
  if cwd ~= before.cwd then
    found[#found + 1] = string.format("the working directory changed to %s (from %s)", cwd, before.cwd)
    uv.chdir(before.cwd)
  end
  return found
end

-- The test's name as busted's output shows it ("describe ... it"), with its
-- file.
local function full_name(element)
  local names, file = { element.name or element.descriptor }, nil
  local parent = busted.parent(element)
  while parent do
    if parent.descriptor == "file" then
      file = parent.name
      break
    end
    if parent.name then
      table.insert(names, 1, parent.name)
    end
    parent = busted.parent(parent)
  end
  return (file and (file .. ": ") or "") .. table.concat(names, " ")
end

local current_test, before_test, before_file = nil, nil, nil

busted.subscribe({ "file", "start" }, function()
  before_file = M.snapshot()
  return nil, true
end)

busted.subscribe({ "test", "start" }, function(element)
  current_test = element
  return nil, true
end)

busted.subscribe({ "file", "end" }, function(file)
  local found = before_file and M.collect_leftovers(before_file) or {}
  before_file = nil
  if #found > 0 then
    error(string.format("leak check: %s did not clean up: %s", file.name, table.concat(found, "; ")), 0)
  end
  return nil, true
end)

-- At the root: runs before every other before_each and after every other
-- after_each (busted runs them outermost first, innermost first).
busted.before_each(function()
  current_test, before_test = nil, M.snapshot()
end)

busted.after_each(function()
  local found = M.collect_leftovers(before_test)
  if #found > 0 then
    local name = current_test and full_name(current_test) or "a test that did not start"
    error(string.format("leak check: test '%s' did not clean up: %s", name, table.concat(found, "; ")), 0)
  end
end)

return M
