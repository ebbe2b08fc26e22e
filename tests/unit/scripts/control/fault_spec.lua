-- wsync.control.fault: the WSYNC_RUNTIME_FAULT spec, parsed and taken per
-- command.
local fault = require("wsync.control.fault")

describe("wsync.control.fault.parse", function()
  it("gives an empty plan for nil and the empty string", function()
    assert.are.same({ own = {}, workers = {} }, fault.parse(nil))
    assert.are.same({ own = {}, workers = {} }, fault.parse(""))
  end)

  it("parses the process's own items, with and without #N", function()
    local parsed = fault.parse("crash@sleep,wrong_id@info#2")
    assert.are.same({
      { kind = "crash", cmd = "sleep", nth = 1, seen = 0 },
      { kind = "wrong_id", cmd = "info", nth = 2, seen = 0 },
    }, parsed.own)
    assert.are.same({}, parsed.workers)
  end)

  it("hands worker items to their rank, joined in order, without the prefix", function()
    local parsed = fault.parse("worker1:hang@wake,eof@shutdown,worker0:garbage@sleep#3,worker1:error@sleep")
    assert.are.same({ [0] = "garbage@sleep#3", [1] = "hang@wake,error@sleep" }, parsed.workers)
    assert.are.same({ { kind = "eof", cmd = "shutdown", nth = 1, seen = 0 } }, parsed.own)
    -- A worker's part is itself a valid spec for that worker.
    assert.are.same({ { kind = "hang", cmd = "wake", nth = 1, seen = 0 },
      { kind = "error", cmd = "sleep", nth = 1, seen = 0 } }, fault.parse(parsed.workers[1]).own)
  end)

  it("accepts every documented kind", function()
    local kinds = {}
    for kind in pairs(fault.KINDS) do
      kinds[#kinds + 1] = kind
      assert.are.equal(kind, fault.parse(kind .. "@info").own[1].kind)
      assert.are.equal(kind .. "@info", fault.parse("worker0:" .. kind .. "@info").workers[0])
    end
    table.sort(kinds)
    assert.are.same({ "bad_result", "crash", "eof", "error", "garbage", "hang", "oversize", "stop", "stubborn",
      "wrong_cmd", "wrong_id", "wrong_protocol" }, kinds)
  end)

  local bad = {
    { "an unknown kind", "explode@sleep", "explode@sleep" },
    { "a missing command", "crash", "crash" },
    { "an empty command", "crash@", "crash@" },
    { "a bad count", "crash@sleep#x", "crash@sleep#x" },
    { "a bad worker prefix", "workerX:crash@sleep", "workerX:crash@sleep" },
    { "a worker item with an unknown kind", "worker0:explode@sleep", "worker0:explode@sleep" },
    { "a bad item after good ones", "crash@sleep,hang@wake,oops", "oops" },
    { "spaces around an item", "crash@sleep, hang@wake", " hang@wake" },
  }
  for _, case in ipairs(bad) do
    it("raises naming the item on " .. case[1], function()
      local ok, err = pcall(fault.parse, case[2])
      assert.is_false(ok)
      assert.matches("bad fault spec item '" .. case[3] .. "'", err, 1, true)
      assert.matches("[worker<R>:]KIND@CMD[#N]", err, 1, true)
    end)
  end
end)

describe("wsync.control.fault.take", function()
  it("fires at the first request of its command by default, once", function()
    local parsed = fault.parse("crash@sleep")
    assert.is_nil(fault.take(parsed, "info"))
    assert.are.equal("crash", fault.take(parsed, "sleep"))
    assert.is_nil(fault.take(parsed, "sleep"))
    assert.is_nil(fault.take(parsed, "sleep"))
  end)

  it("counts requests per command and fires at the N-th", function()
    local parsed = fault.parse("hang@info#3,garbage@wake#2")
    local seen = {}
    for _, cmd in ipairs({ "info", "wake", "info", "sleep", "info", "wake", "info", "wake" }) do
      seen[#seen + 1] = fault.take(parsed, cmd) or "-"
    end
    assert.are.same({ "-", "-", "-", "-", "hang", "garbage", "-", "-" }, seen)
  end)

  it("keeps items on one command apart, each with its own count", function()
    local parsed = fault.parse("error@sleep#2,crash@sleep#3")
    assert.is_nil(fault.take(parsed, "sleep"))
    assert.are.equal("error", fault.take(parsed, "sleep"))
    assert.are.equal("crash", fault.take(parsed, "sleep"))
    assert.is_nil(fault.take(parsed, "sleep"))
  end)

  it("never fires a worker's item in the parsing process", function()
    local parsed = fault.parse("worker0:crash@sleep")
    assert.is_nil(fault.take(parsed, "sleep"))
  end)

  it("never fires for an empty plan", function()
    assert.is_nil(fault.take(fault.parse(nil), "info"))
  end)
end)

describe("wsync.control.fault.items: the one grammar of fault specs", function()
  local trainer = { flags = { drop_expert = true }, prefix = "rank", what = "trainer fault" }

  it("reads items with a prefix, flags, and N when given", function()
    assert.are.same({
      { kind = "die", cmd = "fill", nth = 2, text = "die@fill#2", target = 1 },
      { flag = "drop_expert" },
      { kind = "stale", cmd = "publish", text = "stale@publish" },
    }, fault.items("rank1:die@fill#2,drop_expert,stale@publish", trainer))
  end)

  it("takes any kind when the grammar names none, only its own when it does", function()
    assert.are.equal("anything", fault.items("anything@fill", trainer)[1].kind)
    assert.has_error(function()
      fault.items("anything@fill", { kinds = { die = true }, what = "fault" })
    end, "bad fault 'anything@fill'")
  end)

  it("refuses an unknown flag and a prefix of another grammar, naming the whole item", function()
    assert.has_error(function()
      fault.items("rank0:die@fill,rank2:nonsense", trainer)
    end, "bad trainer fault 'rank2:nonsense'")
    assert.has_error(function()
      fault.items("worker0:die@fill", trainer)
    end, "bad trainer fault 'worker0:die@fill'")
  end)
end)
