--- Line editing for the REPL on a terminal.
---
--- An editor is a state machine over the bytes a terminal in raw mode sends:
--- it keeps the line being edited, the cursor and an in-memory history, and
--- draws the line through the `write` function it was given. It owns no
--- terminal handle and no loop, so the REPL feeds it what it reads and tests
--- feed it strings.
---
--- Keys: printable text (UTF-8 kept whole), Backspace, Delete (ESC[3~),
--- Left/Right (also Ctrl-B/Ctrl-F), Home/End (ESC[H, ESC[F, ESC OH, ESC OF,
--- ESC[1~, ESC[4~, Ctrl-A, Ctrl-E), Ctrl-U (erase to the line start), Ctrl-K
--- (erase to the line end), Ctrl-W (erase the word before the cursor),
--- Up/Down (also Ctrl-P/Ctrl-N) through the history, Ctrl-L (clear the
--- screen), Tab (two spaces), Enter (CR or LF) submits, Ctrl-C cancels the
--- line, Ctrl-D deletes under the cursor or, on an empty line, ends input.
--- Unknown escape sequences and other control bytes are ignored.
---
--- Drawing is single-line: `\r`, prompt, line, erase to the end of the screen
--- line, then the cursor moved back. Columns count UTF-8 characters, so wide
--- characters and lines longer than the terminal are drawn approximately.
local M = {}

---@alias wsync.LineEvent
---| { kind: "line", text: string }  Enter: the submitted line
---| { kind: "eof" }                  Ctrl-D on an empty line
---| { kind: "cancel" }               Ctrl-C: the line was discarded

---@class wsync.LineEditor
---@field line string       text being edited (bytes)
---@field cursor integer    byte offset of the cursor in `line`, 0..#line
---@field prompt string
---@field active boolean    a line is being edited: between `start` and its event
---@field history string[]  submitted lines, oldest first
---@field history_size integer
---@field _write fun(text: string)
---@field _pending string   bytes received and not yet handled
---@field _history_index integer?  entry shown while browsing the history
---@field _draft string?    the line that was being typed before browsing
---@field _after_cr boolean the previous key was CR: a LF right after it is part of it
---@field _dirty boolean    the line changed since it was last drawn
local Editor = {}
Editor.__index = Editor

--- Longest escape sequence kept while waiting for its final byte.
local max_escape_length = 32

local key_actions = {
  ["\1"] = "home",
  ["\2"] = "left",
  ["\3"] = "cancel",
  ["\4"] = "delete_or_eof",
  ["\5"] = "end",
  ["\6"] = "right",
  ["\8"] = "backspace",
  ["\9"] = "tab",
  ["\10"] = "submit",
  ["\11"] = "erase_to_end",
  ["\12"] = "clear_screen",
  ["\13"] = "submit",
  ["\14"] = "history_next",
  ["\16"] = "history_previous",
  ["\21"] = "erase_to_start",
  ["\23"] = "erase_word",
  ["\127"] = "backspace",
  ["\27[A"] = "history_previous",
  ["\27[B"] = "history_next",
  ["\27[C"] = "right",
  ["\27[D"] = "left",
  ["\27[H"] = "home",
  ["\27[F"] = "end",
  ["\27[1~"] = "home",
  ["\27[7~"] = "home",
  ["\27[4~"] = "end",
  ["\27[8~"] = "end",
  ["\27[3~"] = "delete",
  ["\27OA"] = "history_previous",
  ["\27OB"] = "history_next",
  ["\27OC"] = "right",
  ["\27OD"] = "left",
  ["\27OH"] = "home",
  ["\27OF"] = "end",
}

local function is_continuation_byte(byte)
  return byte >= 0x80 and byte < 0xC0
end

--- Terminal columns `text` takes: one per UTF-8 character.
---@param text string
---@return integer
function M.columns(text)
  local _, continuation_bytes = text:gsub("[\128-\191]", "")
  return #text - continuation_bytes
end

-- Byte offset of the character boundary before `cursor` in `line`.
local function previous_boundary(line, cursor)
  local index = cursor
  while index > 0 do
    if not is_continuation_byte(line:byte(index)) then
      return index - 1
    end
    index = index - 1
  end
  return 0
end

-- Byte offset of the character boundary after `cursor` in `line`.
local function next_boundary(line, cursor)
  if cursor >= #line then
    return #line
  end
  local index = cursor + 2
  while index <= #line and is_continuation_byte(line:byte(index)) do
    index = index + 1
  end
  return index - 1
end

-- Splits the next key off `data` at `position`: a control byte, an escape
-- sequence or a run of printable bytes. Returns nil when `data` ends inside
-- an escape sequence (the rest is still to come).
local function next_key(data, position)
  local byte = data:byte(position)
  if byte == 27 then
    local kind = data:sub(position + 1, position + 1)
    if kind == "" then
      return nil
    elseif kind == "[" then
      local final = data:find("[\64-\126]", position + 2)
      if not final then
        if #data - position + 1 > max_escape_length then
          return data:sub(position), #data + 1
        end
        return nil
      end
      return data:sub(position, final), final + 1
    elseif kind == "O" then
      if #data < position + 2 then
        return nil
      end
      return data:sub(position, position + 2), position + 3
    end
    -- ESC followed by anything else (an Alt-modified key): drop the ESC.
    return "\27", position + 1
  elseif byte < 32 or byte == 127 then
    return data:sub(position, position), position + 1
  end
  local stop = data:find("[%z\1-\31\127]", position)
  stop = stop or #data + 1
  return data:sub(position, stop - 1), stop
end

--- Makes an editor. `options.write(text)` receives everything to draw.
---@param options { write: fun(text: string), history_size: integer? }
---@return wsync.LineEditor
function M.new(options)
  return setmetatable({
    line = "",
    cursor = 0,
    prompt = "",
    active = false,
    history = {},
    history_size = options.history_size or 1000,
    _write = options.write,
    _pending = "",
    _history_index = nil,
    _draft = nil,
    _after_cr = false,
    _dirty = false,
  }, Editor)
end

--- Starts editing a new, empty line after `prompt` and draws it.
---@param prompt string
function Editor:start(prompt)
  self.prompt = prompt
  self.line = ""
  self.cursor = 0
  self.active = true
  self._history_index = nil
  self._draft = nil
  self._dirty = false
  self:redraw()
end

--- Draws the prompt and the line, and puts the cursor in place.
function Editor:redraw()
  local back = M.columns(self.line:sub(self.cursor + 1))
  self._write("\r" .. self.prompt .. self.line .. "\27[K" .. (back > 0 and ("\27[" .. back .. "D") or ""))
  self._dirty = false
end

--- Abandons the line being edited (the REPL calls this on SIGINT): moves to
--- a fresh screen line and stops editing; bytes not yet handled are dropped.
function Editor:cancel()
  if self.active then
    self._write("\r\n")
  end
  self.active = false
  self._pending = ""
  self.line, self.cursor = "", 0
end

function Editor:_set(line, cursor)
  self.line = line
  self.cursor = cursor
  self._dirty = true
end

function Editor:_insert(text)
  self:_set(self.line:sub(1, self.cursor) .. text .. self.line:sub(self.cursor + 1), self.cursor + #text)
end

-- Removes the bytes between offsets `from` and `to` and puts the cursor at `from`.
function Editor:_erase(from, to)
  if to > from then
    self:_set(self.line:sub(1, from) .. self.line:sub(to + 1), from)
  end
end

function Editor:_show_history(index)
  self._history_index = index
  local line = index and self.history[index] or self._draft or ""
  if not index then
    self._draft = nil
  end
  self:_set(line, #line)
end

function Editor:_remember(text)
  if text:find("%S") and self.history[#self.history] ~= text then
    self.history[#self.history + 1] = text
    if #self.history > self.history_size then
      table.remove(self.history, 1)
    end
  end
end

-- Ends the line with `event`, drawing what is still undrawn first.
function Editor:_finish(event, ending)
  if self._dirty then
    self:redraw()
  end
  self._write(ending)
  self.active = false
  return event
end

local actions = {}

function actions.home(editor)
  editor.cursor, editor._dirty = 0, true
end

actions["end"] = function(editor)
  editor.cursor, editor._dirty = #editor.line, true
end

function actions.left(editor)
  editor.cursor, editor._dirty = previous_boundary(editor.line, editor.cursor), true
end

function actions.right(editor)
  editor.cursor, editor._dirty = next_boundary(editor.line, editor.cursor), true
end

function actions.backspace(editor)
  editor:_erase(previous_boundary(editor.line, editor.cursor), editor.cursor)
end

function actions.delete(editor)
  editor:_erase(editor.cursor, next_boundary(editor.line, editor.cursor))
end

function actions.delete_or_eof(editor)
  if editor.line == "" then
    return editor:_finish({ kind = "eof" }, "\r\n")
  end
  actions.delete(editor)
end

function actions.erase_to_start(editor)
  editor:_erase(0, editor.cursor)
end

function actions.erase_to_end(editor)
  editor:_erase(editor.cursor, #editor.line)
end

function actions.erase_word(editor)
  local before = editor.line:sub(1, editor.cursor)
  local start = before:find("%S+%s*$") or (#before + 1)
  editor:_erase(start - 1, editor.cursor)
end

function actions.tab(editor)
  editor:_insert("  ")
end

function actions.clear_screen(editor)
  editor._write("\27[H\27[2J")
  editor._dirty = true
end

function actions.history_previous(editor)
  local index = editor._history_index
  if index == nil then
    if #editor.history == 0 then
      return
    end
    editor._draft = editor.line
    editor:_show_history(#editor.history)
  elseif index > 1 then
    editor:_show_history(index - 1)
  end
end

function actions.history_next(editor)
  local index = editor._history_index
  if index == nil then
    return
  end
  editor:_show_history(index < #editor.history and index + 1 or nil)
end

function actions.submit(editor)
  local text = editor.line
  editor:_remember(text)
  editor._history_index, editor._draft = nil, nil
  editor.cursor = #text
  return editor:_finish({ kind = "line", text = text }, "\r\n")
end

function actions.cancel(editor)
  editor._history_index, editor._draft = nil, nil
  return editor:_finish({ kind = "cancel" }, "^C\r\n")
end

--- Adds `bytes` to what was received and handles keys until the line ends or
--- the bytes run out. Returns the event that ended the line, or nil. Bytes
--- after that event wait for the next `start`; while no line is being edited
--- they are only kept. Call `feed("")` after `start` to handle them.
---@param bytes string
---@return wsync.LineEvent?
function Editor:feed(bytes)
  self._pending = self._pending .. bytes
  if not self.active then
    return nil
  end
  local data, position = self._pending, 1
  local event = nil
  while position <= #data and event == nil do
    local key, after = next_key(data, position)
    if key == nil then
      break
    end
    position = after
    local after_cr = self._after_cr
    self._after_cr = key == "\13"
    if not (after_cr and key == "\10") then
      local action = key_actions[key]
      if action then
        event = actions[action](self)
      elseif key:byte(1) >= 32 and key:byte(1) ~= 127 then
        self:_insert(key)
      end
    end
  end
  self._pending = data:sub(position)
  if event == nil and self._dirty then
    self:redraw()
  end
  return event
end

return M
