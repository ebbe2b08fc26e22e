--- Test helper: what code running in this process writes to io.stdout (a
--- session's "wsync: ..." lines), caught instead of printed.
local M = {}

--- Runs `fn(...)` with io.stdout replaced by a sink and returns what it
--- wrote, io.stdout restored; what `fn` raised is raised again, as it was,
--- once io.stdout is back.
---@param fn function
---@return string
function M.captured(fn, ...)
  local saved, written = io.stdout, {}
  io.stdout = { -- luacheck: ignore 122 (this process's stdout, for the call)
    write = function(sink, ...)
      for index = 1, select("#", ...) do
        written[#written + 1] = tostring((select(index, ...)))
      end
      return sink
    end,
    flush = function() end,
  }
  local ok, err = pcall(fn, ...)
  io.stdout = saved -- luacheck: ignore 122
  if not ok then
    error(err, 0)
  end
  return table.concat(written)
end

return M
