--- Test helper: the broken recipes under tests/fixtures/recipes. Each marks
--- its bad line with a trailing "-- bad" comment, optionally followed by
--- ": <field or name>" (the recipe field the error must name, or the global or
--- module that the recipe misuses).
local M = {}

M.recipes = "tests/fixtures/recipes"

--- Every broken fixture: `{file = "bad_param.lua", path = ..., line = 7,
--- subject = "params.steps", field = true}`; `field` tells whether the
--- subject is a recipe field (a schema failure).
M.broken = {
  { file = "syntax_error.lua" },
  { file = "sets_global.lua" },
  { file = "reads_undefined.lua" },
  { file = "requires_other.lua" },
  { file = "returns_string.lua" },
  { file = "runtime_error.lua" },
  { file = "bad_backend.lua", field = true },
  { file = "unknown_field.lua", field = true },
  { file = "bad_param.lua", field = true },
  { file = "bad_name.lua", field = true },
}

--- Line number and subject of the "-- bad" marker in a file.
---@param path string
---@return integer line, string? subject
function M.bad_line(path)
  local number = 0
  for text in io.lines(path) do
    number = number + 1
    local marker = text:match("%-%- bad(.*)$")
    if marker then
      local subject = marker:match("^: (%S+)")
      return number, subject
    end
  end
  error("fixture " .. path .. " has no '-- bad' marker")
end

for _, fixture in ipairs(M.broken) do
  fixture.path = M.recipes .. "/" .. fixture.file
  fixture.line, fixture.subject = M.bad_line(fixture.path)
end

return M
