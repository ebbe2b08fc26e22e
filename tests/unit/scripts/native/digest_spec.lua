-- wsync.native.digest: SHA-256 and hexadecimal through the core.
local digest = require("wsync.native.digest")

describe("digest.hex", function()
  it("writes every byte as two lowercase hex digits", function()
    assert.are.equal("", digest.hex(""))
    assert.are.equal("00ff10a7", digest.hex("\0\255\16\167"))
    local all = {}
    for byte = 0, 255 do
      all[#all + 1] = string.char(byte)
    end
    local text = digest.hex(table.concat(all))
    assert.are.equal(512, #text)
    assert.are.equal("000102", text:sub(1, 6))
    assert.are.equal("fdfeff", text:sub(-6))
  end)

  it("is undone by digest.unhex", function()
    local bytes = "\0wsync\1\2\254\255"
    assert.are.equal(bytes, digest.unhex(digest.hex(bytes)))
    assert.are.equal("\171\205", digest.unhex("ABcd"))
  end)
end)

describe("digest.sha256_hex", function()
  it("gives the SHA-256 of the bytes", function()
    assert.are.equal("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", digest.sha256_hex(""))
  end)
end)
