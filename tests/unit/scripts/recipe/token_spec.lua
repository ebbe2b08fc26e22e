-- wsync.recipe.token: the TCP control endpoint's token, read where the
-- recipe says it is, and refused when it is missing or too short.
local fields = require("wsync.recipe.fields")
local schema = require("wsync.recipe.schema")
local token_module = require("wsync.recipe.token")
local recipes = require("tests.helpers.recipes")

local control_token, model_recipe = token_module.control_token, recipes.model

describe("control_token", function()
  local ffi = require("ffi")
  pcall(ffi.cdef, "int setenv(const char *, const char *, int); int unsetenv(const char *);")
  local TOKEN = "0123456789abcdef0123456789abcdef"

  it("reads the token from the variable or the file, and refuses one that is missing or too short", function()
    local function with(control)
      return assert(schema.check(fields.schema, model_recipe({ control = control })))
    end
    assert.is_nil((control_token(with({ tcp = "127.0.0.1:0" }))))
    ffi.C.setenv("WSYNC_SPEC_TOKEN", TOKEN, 1)
    assert.are.same({ TOKEN, "$WSYNC_SPEC_TOKEN" },
      { control_token(with({ tcp = "127.0.0.1:0", token_env = "WSYNC_SPEC_TOKEN" })) })
    ffi.C.setenv("WSYNC_SPEC_TOKEN", "short", 1)
    local token, message, field = control_token(with({ tcp = "127.0.0.1:0", token_env = "WSYNC_SPEC_TOKEN" }))
    assert.is_nil(token)
    assert.are.equal("control.token_env", field)
    assert.matches("must be at least 16 characters of letters, digits and -._~ (it has 5)", message, 1, true)
    ffi.C.unsetenv("WSYNC_SPEC_TOKEN")
    token, message = control_token(with({ tcp = "127.0.0.1:0", token_env = "WSYNC_SPEC_TOKEN" }))
    assert.is_nil(token)
    assert.matches("the environment variable WSYNC_SPEC_TOKEN, which holds the TCP endpoint's token, is not set",
      message, 1, true)
    local path = os.tmpname()
    local file = assert(io.open(path, "w"))
    file:write("  " .. TOKEN .. "\n")
    file:close()
    assert.are.equal(TOKEN, (control_token(with({ tcp = "127.0.0.1:0", token_file = path }))))
    os.remove(path)
    token, message, field = control_token(with({ tcp = "127.0.0.1:0", token_file = path }))
    assert.is_nil(token)
    assert.are.equal("control.token_file", field)
    assert.matches("cannot read the TCP endpoint's token from " .. path, message, 1, true)
  end)

  it("refuses a token with characters an endpoint's URL does not carry", function()
    local path = os.tmpname()
    local file = assert(io.open(path, "w"))
    file:write(TOKEN:sub(1, 20) .. "/" .. TOKEN:sub(21))
    file:close()
    local found, message, field = control_token(assert(schema.check(fields.schema,
      model_recipe({ control = { tcp = "127.0.0.1:0", token_file = path } }))))
    os.remove(path)
    assert.is_nil(found)
    assert.are.equal("control.token_file", field)
    assert.are.equal(string.format("the token in the file %s must be at least %d characters of letters, digits and "
      .. "-._~ (it has 33); e.g. openssl rand -hex 16", path, token_module.MIN_TOKEN), message)
  end)
end)
