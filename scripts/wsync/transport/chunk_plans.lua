--- The plans of a session's chunks on one side of the data plane (a trainer
--- rank's fills, a TP worker's loads): by chunk number, each chunk's plan
--- (`{segment, plan?, ...}`: the manifest segment of the chunk's records and
--- what the transport made of it), and the manifests of sequences of chunks,
--- each hashed once (wsync.native.manifest.digest_cache).
local manifest_module = require("wsync.native.manifest")

local M = {}

---@class wsync.ChunkPlans
---@field transport table  the backend's transport (wsync.transport)
local ChunkPlans = {}
ChunkPlans.__index = ChunkPlans

--- No chunk planned yet; `transport` closes the plans it made.
---@param transport table
---@return wsync.ChunkPlans
function M.new(transport)
  return setmetatable({ transport = transport, by_chunk = {}, segments = {},
    digests = manifest_module.digest_cache() }, ChunkPlans)
end

-- Closes chunk plan `chunk` (nil: none): its segment and the transport's plan.
function ChunkPlans:_close(chunk)
  if chunk then
    chunk.segment:close()
    self.transport.close_plan(chunk.plan)
  end
end

--- Chunk `k`'s plan, or nil.
---@param k integer
---@return table?
function ChunkPlans:get(k)
  return self.by_chunk[k]
end

--- The highest chunk number from 1 with none missing before it.
---@return integer
function ChunkPlans:count()
  return #self.by_chunk
end

--- Keeps `chunk` as chunk `k`'s plan, closing the one it replaces.
---@param k integer
---@param chunk {segment: table, plan: any}
function ChunkPlans:put(k, chunk)
  self:_close(self.by_chunk[k])
  self.by_chunk[k], self.segments[k] = chunk, chunk.segment
  self.digests:clear()
end

--- Closes every chunk's plan (a new session, or another family).
function ChunkPlans:clear()
  for _, chunk in pairs(self.by_chunk) do
    self:_close(chunk)
  end
  self.by_chunk, self.segments = {}, {}
  self.digests:clear()
end

--- The manifest of chunks `sequence` in order: `{digest, count, bytes}`, or
--- nil and a message.
---@param sequence integer[]
---@return {digest: string, count: integer, bytes: number}|nil, string?
function ChunkPlans:manifest(sequence)
  return self.digests:of(sequence, self.segments)
end

return M
