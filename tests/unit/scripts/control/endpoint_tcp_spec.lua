-- The TCP side of the control endpoint: addresses, and the token check that
-- stands in for the unix socket's user check.
local endpoint = require("wsync.control.endpoint")

describe("wsync.control.endpoint over TCP", function()
  it("reads ADDRESS:PORT and [IPv6]:PORT, and names what is not one", function()
    assert.are.same({ "10.0.0.1", 4000 }, { endpoint.parse_address("10.0.0.1:4000") })
    assert.are.same({ "::1", 0 }, { endpoint.parse_address("[::1]:0") })
    for _, bad in ipairs({ "10.0.0.1", "host:port", "10.0.0.1:70000", ":80" }) do
      local address, why = endpoint.parse_address(bad)
      assert.is_nil(address)
      assert.are.equal(bad .. " is not ADDRESS:PORT", why)
    end
  end)

  it("takes the session's token only", function()
    local token = "0123456789abcdef0123456789abcdef"
    assert.is_true(endpoint.token_matches(token, token))
    assert.is_false(endpoint.token_matches(token, "0123456789abcdef0123456789abcdee"))
    assert.is_false(endpoint.token_matches(token, token:sub(1, 31)))
    assert.is_false(endpoint.token_matches(token, nil))
    assert.is_false(endpoint.token_matches(token, 7))
  end)
end)
