-- libwsync's agent API (bindings/agent.c, policy in wsync.trainer.agent_api) called
-- through LuaJIT's FFI the way a C trainer calls it: argument checks, call
-- order and error texts. The agent runs in a second host opened here and
-- connects to a socket of this test that accepts connections (the kernel's
-- backlog) but never answers, so nothing here waits on a wsync host.
local ffi = require("ffi")
local uv = require("luv")
local C = require("wsync.native.ffi")

local function bf16_rows(rows, columns)
  return ffi.new("uint16_t[?]", rows * columns), rows * columns * 2
end

describe("the agent API through the FFI", function()
  local host, directory, server, endpoint

  before_each(function()
    local out = ffi.new("ws_host *[1]")
    assert.are.equal(0, C.ws_host_open(out))
    host = out[0]
    directory = assert(uv.fs_mkdtemp((os.getenv("TMPDIR") or "/tmp") .. "/wsync-agent-spec-XXXXXX"))
    endpoint = directory .. "/control.sock"
    server = uv.new_pipe(false)
    assert(server:bind(endpoint))
    assert(server:listen(4, function() end))
  end)

  after_each(function()
    C.ws_host_close(host)
    server:close()
    uv.run("nowait")
    uv.fs_unlink(endpoint)
    uv.fs_rmdir(directory)
  end)

  local function open(rank, world)
    local out = ffi.new("ws_agent *[1]")
    local status = C.ws_agent_open(host, endpoint, rank or 0, world or 2, "host", -1, out)
    return status, out[0]
  end

  local function host_error()
    return ffi.string(C.ws_host_error(host))
  end

  it("refuses a rank outside the world and a missing host, in the host's error", function()
    local status, agent = open(2, 2)
    assert.are.equal(C.WS_EINVAL, status)
    assert.is_true(agent == nil)
    assert.matches("0 <= rank < world (rank 2, world 2)", host_error(), 1, true)
    local out = ffi.new("ws_agent *[1]")
    assert.are.equal(C.WS_EINVAL, C.ws_agent_open(nil, endpoint, 0, 1, nil, 0, out))
  end)

  describe("without an endpoint", function()
    pcall(ffi.cdef, "int setenv(const char *, const char *, int); int unsetenv(const char *);")
    local saved = os.getenv("WSYNC_ENDPOINT")
    after_each(function()
      if saved then
        ffi.C.setenv("WSYNC_ENDPOINT", saved, 1)
      else
        ffi.C.unsetenv("WSYNC_ENDPOINT")
      end
    end)

    it("connects to $WSYNC_ENDPOINT", function()
      ffi.C.setenv("WSYNC_ENDPOINT", endpoint, 1)
      local out = ffi.new("ws_agent *[1]")
      assert.are.equal(0, C.ws_agent_open(host, nil, 0, 1, nil, 0, out), host_error())
      C.ws_agent_close(out[0])
    end)

    it("fails naming WSYNC_ENDPOINT when it is not set", function()
      ffi.C.unsetenv("WSYNC_ENDPOINT")
      local out = ffi.new("ws_agent *[1]")
      assert.are.equal(C.WS_EFAILED, C.ws_agent_open(host, nil, 0, 1, nil, 0, out))
      assert.is_true(out[0] == nil)
      assert.matches("rank 0: no endpoint given and WSYNC_ENDPOINT is not set: set it to the host's control "
        .. "endpoint", host_error(), 1, true)
    end)
  end)

  it("fails with EFAILED and says why when nothing listens on the endpoint", function()
    local out = ffi.new("ws_agent *[1]")
    local status = C.ws_agent_open(host, directory .. "/nothing.sock", 1, 2, nil, -1, out)
    assert.are.equal(C.WS_EFAILED, status)
    assert.is_true(out[0] == nil)
    assert.matches("rank 1 cannot connect to " .. directory .. "/nothing.sock", host_error(), 1, true)
    assert.matches("(AGENT_CONNECT)", host_error(), 1, true)
  end)

  it("checks each tensor and says which one is wrong", function()
    local status, agent = open()
    assert.are.equal(0, status, host_error())
    local data, bytes = bf16_rows(3, 4)
    local shape = ffi.new("int64_t[2]", { 6, 4 })
    assert.are.equal(0, C.ws_agent_register_tensor(agent, "w", "bfloat16", shape, 2, data, bytes, 3, 3))
    assert.are.equal("", ffi.string(C.ws_agent_error(agent)))

    local function refused(expected, ...)
      assert.are.equal(C.WS_EINVAL, C.ws_agent_register_tensor(agent, ...))
      assert.matches(expected, ffi.string(C.ws_agent_error(agent)), 1, true)
    end
    refused("register_tensor w: this rank registered that name already", "w", "bfloat16", shape, 2, data, bytes, 0,
      3)
    refused("register_tensor: unknown dtype bfloat17", "x", "bfloat17", shape, 2, data, bytes, 0, 3)
    refused("register_tensor x: rows [4, +3) outside dim 0 of 6", "x", "bfloat16", shape, 2, data, bytes, 4, 3)
    refused("register_tensor x: shard runs past its memory", "x", "bfloat16", shape, 2, data, bytes - 2, 0, 3)
    refused("ws_agent_register_tensor x: data is NULL", "x", "bfloat16", shape, 2, nil, 0, 0, 3)
    refused("ws_agent_register_tensor x: needs a name, a dtype and a shape", "x", "bfloat16", shape, 0, data, bytes,
      0, 3)
    refused("ws_agent_register_tensor x: a dim is negative", "x", "bfloat16", ffi.new("int64_t[1]", { -1 }), 1,
      data, bytes, 0, 0)
    -- An empty shard needs no memory.
    assert.are.equal(0, C.ws_agent_register_tensor(agent, "empty", "bfloat16", shape, 2, nil, 0, 6, 0))
    C.ws_agent_close(agent)
  end)

  it("checks callbacks and refuses publish before ready", function()
    local status, agent = open()
    assert.are.equal(0, status, host_error())
    assert.are.equal(C.WS_EINVAL, C.ws_agent_register_callback(agent, "offload_actor", nil, nil))
    assert.matches("ws_agent_register_callback offload_actor: needs a name and a function",
      ffi.string(C.ws_agent_error(agent)), 1, true)
    assert.are.equal(C.WS_EINVAL, C.ws_agent_register_confirmed_callback(agent, nil, nil, nil))
    assert.matches("ws_agent_register_confirmed_callback (NULL): needs a name and a function",
      ffi.string(C.ws_agent_error(agent)), 1, true)
    local result = ffi.new("ws_publish_result")
    result.receipts = 7
    assert.are.equal(C.WS_ESTATE, C.ws_agent_publish(agent, 1, result))
    assert.matches("publish: call ready first", ffi.string(C.ws_agent_error(agent)), 1, true)
    assert.are.equal(0, result.receipts, "a failed publish leaves a zeroed result")
    C.ws_agent_close(agent)
  end)

  it("accepts NULL in ws_agent_error and ws_agent_close", function()
    assert.are.equal("", ffi.string(C.ws_agent_error(nil)))
    C.ws_agent_close(nil)
  end)

  it("says in ws_last_error why an open failed, and nothing once one succeeds", function()
    local status = open(2, 2)
    assert.are.equal(C.WS_EINVAL, status)
    assert.are.equal(host_error(), ffi.string(C.ws_last_error()))
    assert.matches("0 <= rank < world (rank 2, world 2)", ffi.string(C.ws_last_error()), 1, true)
    local agent
    status, agent = open()
    assert.are.equal(0, status, host_error())
    assert.are.equal("", ffi.string(C.ws_last_error()))
    C.ws_agent_close(agent)
  end)

  it("refuses every call but close of an agent whose host closed, and close frees it", function()
    local status, agent = open()
    assert.are.equal(0, status, host_error())
    C.ws_host_close(host)
    host = nil -- after_each closes NULL
    assert.are.equal(C.WS_ESTATE, C.ws_agent_ready(agent))
    assert.matches("ws_agent_ready: the agent's host was closed; only ws_agent_close remains",
      ffi.string(C.ws_agent_error(agent)), 1, true)
    local data, bytes = bf16_rows(1, 4)
    local shape = ffi.new("int64_t[2]", { 1, 4 })
    assert.are.equal(C.WS_ESTATE, C.ws_agent_register_tensor(agent, "w", "bfloat16", shape, 2, data, bytes, 0, 1))
    assert.are.equal(C.WS_ESTATE, C.ws_agent_publish(agent, 1, nil))
    assert.are.equal(C.WS_ESTATE, C.ws_agent_set_interrupt_check(agent, nil, nil))
    C.ws_agent_close(agent)
  end)

  it("removes an interrupt check with NULL, and refuses a NULL agent", function()
    local status, agent = open()
    assert.are.equal(0, status, host_error())
    assert.are.equal(0, C.ws_agent_set_interrupt_check(agent, nil, nil), ffi.string(C.ws_agent_error(agent)))
    assert.are.equal(C.WS_EINVAL, C.ws_agent_set_interrupt_check(nil, nil, nil))
    C.ws_agent_close(agent)
  end)
end)
