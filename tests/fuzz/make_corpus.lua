--- Writes the fuzz target's seed corpus, tests/fuzz/corpus/: for every mode
--- of tests/fuzz/entry.lua, valid frames of every command (each request and
--- each result checked against wsync.control.messages first), and every
--- committed recipe. Run from the repository root after a message shape
--- changes: `build/wsync tests/fuzz/make_corpus.lua`.
local uv = require("luv")
local entry = require("tests.fuzz.entry")
local messages = require("wsync.control.messages")
local protocol = require("wsync.control.protocol")

local OUT = "tests/fuzz/corpus"

local MANIFEST = string.rep("0123456789abcdef", 4)
local PUBLICATION = string.rep("0f", 16)

-- A valid payload or result for every command of every schema table.
local examples = {
  to_host = {
    hello = { token = string.rep("0123456789abcdef", 2) },
    register = {
      rank = 0, world = 2, hostname = "node", pid = 4242,
      device = { backend = "host", index = 0, uuid = "host-0", free_bytes = 1048576 },
      tensors = {
        { name = "model.norm.weight", dtype = "bfloat16", shape = { 64 }, rows = { 0, 32 } },
        { name = "model.embed_tokens.weight", dtype = "float32", shape = { 128, 64 }, rows = { 0, 64 } },
      },
      callbacks = { "offload_optimizer", "onload_optimizer" },
    },
    state = {},
    publish = { rank = 0, step = 3 },
  },
  from_agent = {
    init_buffers = { names = { "wsync-1-0-0", "wsync-1-0-1" }, uuid = "host-0" },
    attach = {},
    fill = { bytes = 4096, rank = 0, consumed = { manifest = MANIFEST, tensors = 2, bytes = 8192, rank = 0 } },
    verify = { manifest = MANIFEST, tensors = 2, bytes = 8192, rank = 0 },
    memory = { free_bytes = 1024, total_bytes = 4096 },
    callback = {},
    process_memory = { lua_heap_bytes = 1024, rss_bytes = 65536, pid = 4242 },
    nccl_id = { id = string.rep("0a", 64) },
    abort = {},
    values_sums = { workers = { { ["model.norm.weight"] = "0123456789abcdef" } } },
  },
  from_host = {
    hello = {},
    register = { plan = { chunks = 2, tensors = 3 }, model_version = 0 },
    state = {},
    publish = { model_version = 1, publication_id = PUBLICATION, receipts = 2, manifest = MANIFEST },
  },
  to_agent = {
    init_buffers = { count = 2, bytes = 163840 },
    attach = { buffers = { { "wsync-1-0-0", "wsync-1-0-1" }, { "wsync-1-1-0", "wsync-1-1-1" } } },
    fill = { chunk = 1, buffer = 1, slots = { { tensor = 1, offset = 0, bytes = 64 } },
      begin = { family = "qwen3_moe", publication_id = PUBLICATION }, verify = true },
    verify = {},
    memory = {},
    callback = { name = "offload_optimizer" },
    process_memory = {},
    nccl_id = {},
    values_sums = { family = "qwen3_moe", config = { hidden_size = 64 }, tp = 2 },
    abort = { code = "PEER_LOST", message = "rank 1 closed the connection", phase = "publish", rank = 1 },
  },
  from_runtime = {
    info = {
      protocol = 1, tp_world = 2, state = { weights = "awake" },
      workers = {
        { rank = 0, pid = 101, device = { uuid = "host-0" }, state = {} },
        { rank = 1, pid = 102, device = { uuid = "host-1" }, state = {} },
      },
    },
    load_chunk = { bytes = 4096 },
    finish_update = { model_version = 1, receipts = { { rank = 0, manifest = MANIFEST } }, prefix_cache_reset = true },
    resident_checksums = { workers = { { rank = 0, tensors = { ["model.norm.weight"] = "abcd" } } } },
    resident_values = { workers = { { rank = 0, tensors = { ["model.norm.weight"] = "0123456789abcdef" } } } },
  },
}

local function sorted_keys(map)
  local keys = {}
  for key in pairs(map) do
    keys[#keys + 1] = key
  end
  table.sort(keys)
  return keys
end

-- Every example fits its schema, and every command has one.
for _, table_name in ipairs(entry.SCHEMA_TABLES) do
  for _, cmd in ipairs(sorted_keys(messages[table_name])) do
    local example = examples[table_name][cmd]
    assert(example, table_name .. "." .. cmd .. " has no example")
    local _, bad = messages.check(messages[table_name], cmd, example)
    assert(bad == nil, table_name .. "." .. cmd .. ": " .. tostring(bad))
  end
end

local written = 0
local function write_file(name, bytes)
  local file = assert(io.open(OUT .. "/" .. name, "wb"))
  file:write(bytes)
  file:close()
  written = written + 1
end

-- Writes the input of `mode` with the list of frames `frames` twice: as a raw
-- stream, and as framed lines (NAME-lines). `choice`: the choice byte of the
-- peer and server modes.
local function write(name, mode, choice, frames)
  local bodies = {}
  for index, frame in ipairs(frames) do
    bodies[index] = frame:sub(5)
    assert(not bodies[index]:find("\n"), "a frame body with a newline")
  end
  write_file(name, entry.mode_byte(mode) .. (choice or "") .. table.concat(frames))
  write_file(name .. "-lines", entry.mode_byte(mode, true) .. (choice or "") .. table.concat(bodies, "\n"))
end

local function requests(table_name, first_id)
  local frames = {}
  for index, cmd in ipairs(sorted_keys(examples[table_name])) do
    frames[index] = protocol.encode(protocol.request(first_id + index - 1, cmd, examples[table_name][cmd]))
  end
  return frames
end

local function response(id, cmd, result)
  return protocol.encode(protocol.success({ id = id, cmd = cmd }, result))
end

assert(uv.fs_stat(OUT), OUT .. " is missing (run from the repository root)")
local scanner = uv.fs_scandir(OUT)
while scanner do
  local name = uv.fs_scandir_next(scanner)
  if not name then
    break
  end
  assert(os.remove(OUT .. "/" .. name))
end

-- frames: each request and each result alone, a failure, and one stream of
-- them all.
local all = {}
for _, table_name in ipairs({ "to_host", "to_agent" }) do
  for index, frame in ipairs(requests(table_name, 1)) do
    write(string.format("frames-%s-%s", table_name, sorted_keys(examples[table_name])[index]), "frames", nil, { frame })
    all[#all + 1] = frame
  end
end
for _, table_name in ipairs({ "from_agent", "from_host", "from_runtime" }) do
  for _, cmd in ipairs(sorted_keys(examples[table_name])) do
    local frame = response(1, cmd, examples[table_name][cmd])
    write(string.format("frames-%s-%s", table_name, cmd), "frames", nil, { frame })
    all[#all + 1] = frame
  end
end
local failure = protocol.encode(protocol.failure({ id = 4, cmd = "fill" }, "FILL_FAILED", "rank 0 cannot fill chunk 2",
  { fatal = true, traceback = "stack traceback:\n\t[C]: in ?", phase = "fill", rank = 0 }))
write("frames-failure", "frames", nil, { failure })
all[#all + 1] = failure
write("frames-stream", "frames", nil, all)

-- host_peer and agent_peer: the first byte k picks the k-th command (sorted)
-- of the results the peer waits for as its own request; the stream answers
-- it (id 1), then sends every request the peer answers.
local sides = {
  host_peer = { requests = "to_host", results = "from_agent" },
  agent_peer = { requests = "to_agent", results = "from_host" },
}
for _, mode in ipairs({ "host_peer", "agent_peer" }) do
  local side = sides[mode]
  local incoming = requests(side.requests, 1)
  write(mode .. "-requests", mode, "\0", incoming)
  for index, cmd in ipairs(sorted_keys(examples[side.results])) do
    local frames = { response(1, cmd, examples[side.results][cmd]) }
    for _, frame in ipairs(incoming) do
      frames[#frames + 1] = frame
    end
    write(string.format("%s-answers-%s", mode, cmd), mode, string.char(index), frames)
  end
  write(mode .. "-remote-failure", mode, "\1",
    { protocol.encode(protocol.failure({ id = 1, cmd = sorted_keys(examples[side.results])[1] }, "REFUSED", "no")) })
  -- Handlers that fail with a coded error (32) and with a plain one (64).
  write(mode .. "-handlers-refuse", mode, "\32", incoming)
  write(mode .. "-handlers-raise", mode, "\64", incoming)
end

-- server: requests of the runtime's commands, and a version mismatch.
local server_requests = {}
for index, cmd in ipairs({ "info", "sleep", "wake", "load_chunk", "finish_update", "shutdown" }) do
  server_requests[index] = protocol.encode(protocol.request(index, cmd, { level = 1, tags = { "weights" } }))
end
write("server-requests", "server", "\0", server_requests)
write("server-handlers-raise", "server", "\64", server_requests)
local mismatch = protocol.request(1, "info")
mismatch.protocol = 2
write("server-protocol-mismatch", "server", "\0", { protocol.encode(mismatch) })

-- recipe: every committed recipe and recipe fixture.
for _, folder in ipairs({ "recipes", "tests/fixtures/recipes" }) do
  scanner = uv.fs_scandir(folder)
  local names = {}
  while scanner do
    local name, kind = uv.fs_scandir_next(scanner)
    if not name then
      break
    end
    if kind == "file" and name:match("%.lua$") then -- (not recipes/models/)
      names[#names + 1] = name
    end
  end
  table.sort(names)
  for _, name in ipairs(names) do
    local file = assert(io.open(folder .. "/" .. name, "rb"))
    local text = file:read("*a")
    file:close()
    write_file("recipe-" .. (folder == "recipes" and "" or "fixture-") .. name:gsub("%.lua$", ""),
      entry.mode_byte("recipe") .. text)
  end
end

-- recipe: one that runs forever, inside a pcall (the budget refuses it).
write_file("recipe-runs-forever", entry.mode_byte("recipe")
  .. "while true do\n  pcall(function() while true do end end)\nend\n")

print(string.format("make_corpus: %d inputs in %s", written, OUT))
