--- The shapes of the control messages between the host and a trainer agent:
--- the payload of every request each end may send, and the result of every
--- request the host sends. Both ends check what they receive against these
--- before a handler or a caller reads a field, so that a malformed message
--- (a field missing, of the wrong type, out of range) is answered with a coded
--- error naming the field instead of failing somewhere inside a handler.
local schema = require("wsync.recipe.schema")

local M = {}

local index = schema.number({ integer = true, min = 0 })
local bytes = schema.number({ integer = true, min = 0 })
local name = schema.string({ pattern = "^[^%z]+$" })
local required_name = schema.string({ pattern = "^[^%z]+$", required = true })

local function record(fields, options)
  options = options or {}
  options.fields = fields
  return schema.record(options)
end

local empty = record({}, { open = true })

-- A registered tensor: its global shape and the dim-0 rows this rank holds.
local tensor = record({
  name = required_name,
  dtype = schema.string({ required = true, pattern = "^[%w_]+$" }),
  shape = schema.list({ item = bytes, min_length = 1, max_length = 8, required = true }),
  rows = schema.list({ item = bytes, min_length = 2, max_length = 2, required = true }),
}, {
  check = function(value)
    if value.rows[1] + value.rows[2] > value.shape[1] then
      return false, string.format("rows [%d, +%d) run past dim 0 of %d", value.rows[1], value.rows[2], value.shape[1]),
        "rows"
    end
    return true
  end,
})

-- A rank's consumed manifest (its answer to verify; with its last fill).
local consumed = record({
  manifest = schema.string({ pattern = "^" .. string.rep("%x", 64) .. "$", required = true }),
  tensors = schema.number({ integer = true, min = 0, required = true }),
  bytes = bytes,
  rank = index,
})

local device = record({
  backend = schema.enum({ "host", "cuda", required = true }),
  index = schema.number({ integer = true, min = 0, required = true }),
  uuid = schema.string({ required = true, pattern = "^[%w-]+$" }),
  free_bytes = bytes,
})

--- Requests an agent sends to the host, by command.
M.to_host = {
  -- A TCP connection's first request: the session's token
  -- (wsync.control.endpoint answers it before any handler).
  hello = record({ token = schema.string({ pattern = "^%x+$", required = true }) }),
  register = record({
    rank = schema.number({ integer = true, min = 0, required = true }),
    world = schema.number({ integer = true, min = 1, required = true }),
    device = record(device.fields, { required = true }),
    tensors = schema.list({ item = tensor, required = true }),
    callbacks = schema.list({ item = name, default = {} }),
    hostname = schema.string({ required = true }),
    pid = schema.number({ integer = true, min = 1, required = true }),
  }),
  state = empty,
  publish = record({
    rank = index,
    step = schema.number({ integer = true, min = 0 }),
    -- (What this rank asks the schedule's "generate" step to generate, with
    -- the weights just published: its prompts as token ids, and sampling as
    -- the runtime's generate takes it; the answer's `generation` has the
    -- outputs.)
    generate = record({
      prompts = schema.list({ item = schema.list({ item = index, min_length = 1 }), min_length = 1,
        required = true }),
      sampling = schema.map({ item = schema.any({}) }),
    }),
  }),
}

--- Results of the requests the host sends to an agent, by command.
M.from_agent = {
  init_buffers = record({
    names = schema.list({ item = name, min_length = 1, required = true }),
    uuid = schema.string({ required = true }),
    -- (direct path: where each registered tensor lies in the storage
    -- `names` exports, by tensor name: {memory, offset})
    locations = schema.map({ item = record({ memory = schema.number({ integer = true, min = 1, required = true }),
      offset = schema.number({ integer = true, min = 0, required = true }) }) }),
    -- (chunks ordered on the device: the rank's gate, as its buffers' names)
    gate = name,
  }),
  attach = empty,
  fill = record({ bytes = bytes, rank = index, consumed = record(consumed.fields) }, { open = true }),
  verify = consumed,
  memory = record({ free_bytes = bytes, total_bytes = bytes }),
  -- (bytes: what the callback said it moved, when it said: ws_agent_report_moved.)
  callback = record({ bytes = bytes }),
  process_memory = record({ lua_heap_bytes = bytes, rss_bytes = bytes, pid = index }),
  nccl_id = record({ id = schema.string({ pattern = "^%x+$", required = true }) }),
  abort = empty,
  -- by TP worker (1-based): {resident tensor name = 16 hex digits}
  values_sums = record({
    workers = schema.list({ item = schema.map({ item = schema.string({ pattern = "^" .. string.rep("%x", 16)
      .. "$" }) }), required = true }),
  }),
}

--- Results of the requests an agent sends to the host, by command.
M.from_host = {
  hello = empty,
  register = record({ plan = schema.map({ item = schema.any({}) }), model_version = index }),
  state = empty,
  publish = record({
    model_version = schema.number({ integer = true, min = 1, required = true }),
    publication_id = schema.string({ pattern = "^" .. string.rep("%x", 32) .. "$", required = true }),
    receipts = schema.number({ integer = true, min = 1, required = true }),
    manifest = schema.string({ pattern = "^" .. string.rep("%x", 64) .. "$", required = true }),
    -- (the round's report as JSON text: its steps and the publication's
    -- phases, timed; wsync.publish.report.round_json)
    report = schema.string({}),
    -- (as JSON text, when this rank asked publish to generate: {model_version,
    -- outputs}, its own prompts' outputs in order)
    generation = schema.string({}),
  }),
}

--- Requests the host sends to an agent, by command (the agent checks them).
M.to_agent = {
  init_buffers = record({
    count = schema.number({ integer = true, min = 1, max = 8, required = true }),
    bytes = schema.number({ integer = true, min = 0, required = true }),
    direct = schema.boolean({}),
    gate = schema.boolean({}),
  }),
  attach = record({
    buffers = schema.list({ item = schema.list({ item = name, min_length = 1 }), min_length = 1, required = true }),
    nccl_id = schema.string({ pattern = "^%x+$" }),
  }),
  -- (fill's slots come with a chunk's first fill of a session only, and are
  -- checked one by one where they are planned: the list is long. `begin`
  -- comes with a publication's first fill: the rank starts it then.)
  fill = record({
    chunk = schema.number({ integer = true, min = 1, required = true }),
    buffer = schema.number({ integer = true, min = 1, required = true }),
    slots = schema.any({}),
    begin = record({
      family = schema.string({ required = true }),
      publication_id = schema.string({ pattern = "^" .. string.rep("%x", 32) .. "$", required = true }),
    }),
    -- (the publication's last fill: answer with the consumed manifest too)
    verify = schema.boolean({}),
    -- (chunks ordered on the device: wait for LOADED >= after, then FILLED =
    -- seq; uint32)
    gate = record({
      after = schema.number({ integer = true, min = 0, max = 4294967295 }),
      seq = schema.number({ integer = true, min = 0, max = 4294967295, required = true }),
    }),
  }),
  verify = empty,
  memory = empty,
  callback = record({ name = schema.string({ required = true }) }),
  process_memory = empty,
  nccl_id = empty,
  values_sums = record({
    family = schema.string({ required = true }),
    config = schema.map({ item = schema.any({}), required = true }),
    tp = schema.number({ integer = true, min = 1, required = true }),
  }),
  -- The session failed: the agent raises this error from its next publish
  -- (the fields of a wsync error).
  abort = record({
    code = schema.string({ required = true }),
    message = schema.string({ required = true }),
    phase = schema.string({}),
    rank = index,
  }, { open = true }),
}

local worker_info = record({
  rank = schema.number({ integer = true, min = 0, required = true }),
  pid = schema.number({ integer = true, min = 1, required = true }),
  device = record({ uuid = schema.string({ required = true }) }, { open = true, required = true }),
  state = schema.map({ item = schema.any({}) }),
}, { open = true })

--- Results of the requests the host sends to a rollout runtime, by command
--- (the fields the host reads; a runtime may say more).
M.from_runtime = {
  info = record({
    protocol = schema.number({ integer = true, required = true }),
    tp_world = schema.number({ integer = true, min = 1, required = true }),
    workers = schema.list({ item = worker_info, min_length = 1, required = true }),
    state = schema.map({ item = schema.any({}), required = true }),
  }, { open = true }),
  load_chunk = record({ bytes = bytes }, { open = true }),
  finish_update = record({
    model_version = schema.number({ integer = true, min = 1, required = true }),
    receipts = schema.list({ item = schema.map({ item = schema.any({}) }), required = true }),
    prefix_cache_reset = schema.boolean({}),
  }, { open = true }),
  resident_checksums = record({
    workers = schema.list({ item = record({
      rank = schema.number({ integer = true, min = 0, required = true }),
      tensors = schema.map({ item = schema.string({}), required = true }),
    }), required = true }),
  }, { open = true }),
  resident_values = record({
    workers = schema.list({ item = record({
      rank = schema.number({ integer = true, min = 0, required = true }),
      tensors = schema.map({ item = schema.string({ pattern = "^" .. string.rep("%x", 16) .. "$" }),
        required = true }),
    }), required = true }),
  }, { open = true }),
}

--- Checks `payload` against `schemas[cmd]`. Returns the checked payload, or
--- nil and what is wrong ("register: field 'device.uuid': is required"). A
--- command without a schema passes unchanged.
---@param schemas table<string, table>
---@param cmd string
---@param payload any
---@return any, string?
function M.check(schemas, cmd, payload)
  local spec = schemas[cmd]
  if not spec then
    return payload
  end
  local checked, failure = schema.check(spec, payload)
  if checked == nil then
    if failure.path == "" then
      return nil, string.format("%s: %s", cmd, failure.message)
    end
    return nil, string.format("%s: field '%s': %s", cmd, failure.path, failure.message)
  end
  return checked
end

return M
