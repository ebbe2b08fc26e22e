---@meta wsync._nccl
-- LuaCATS stubs for `wsync._nccl` (bindings/l_nccl.c): NCCL communicators
-- among trainer ranks, NCCL loaded on first use (dlopen of libnccl.so.2, or
-- $WSYNC_NCCL_LIBRARY). Not loaded at run time; read by the Lua language
-- server. tests/bindings/meta_spec.lua checks the stubs.
--
-- Without NCCL: nil, message, "ENODEV" naming the library and the loader's
-- reason. NCCL failures: "ENCCL" with NCCL's own result name.

---One root's rows of one tensor slot; every rank passes the same list.
---@class wsync.nccl.Broadcast
---@field root integer            the rank whose rows these are (from 0)
---@field target_offset integer?  where they go in every packed buffer, default 0
---@field bytes integer           0 skips it on every rank
---@field source integer?         on the root: index (from 1) into the source regions
---@field source_offset integer?  on the root: offset in that region, default 0

---@class wsync._nccl
local nccl = {}

---@return true|nil ok, string? message, string? code
function nccl.load() end

---@return integer|nil version, string? message, string? code  e.g. 22809
function nccl.version() end

---@return string|nil id, string? message, string? code  128 bytes, for the host to hand out
function nccl.unique_id() end

---Joins the communicator; blocks until every rank joined unless nonblocking.
---@param device integer
---@param world integer
---@param rank integer
---@param id string
---@param nonblocking boolean?  then poll comm:ready() (and abort on a deadline)
---@return wsync.nccl.Comm|nil comm, string? message, string? code
function nccl.init(device, world, rank, id, nonblocking) end

---@class wsync.nccl.Comm
local Comm = {}
---@return boolean|nil ready, string? message, string? code
function Comm:ready() end
---@return integer
function Comm:rank() end
---@return integer
function Comm:world() end
---@return integer
function Comm:device() end
---Queues one chunk's fill as one NCCL group: a broadcast per root per slot.
---@param stream wsync.cuda.Stream?
---@param target wsync.cuda.RegionLike       this rank's packed buffer
---@param sources wsync.cuda.RegionLike[]    this rank's shard storage
---@param broadcasts wsync.nccl.Broadcast[]|string  tables, or packed ws_nccl_broadcast records
---@return true|nil ok, string? message, string? code
function Comm:fill(stream, target, sources, broadcasts) end
---Queues one all-gather of equal blocks (rank r's block at target_offset + r * bytes).
---@param stream wsync.cuda.Stream?
---@param target wsync.cuda.RegionLike
---@param target_offset integer
---@param source wsync.cuda.RegionLike
---@param source_offset integer
---@param bytes integer  a rank's block
---@return true|nil ok, string? message, string? code
function Comm:all_gather(stream, target, target_offset, source, source_offset, bytes) end
---@return true|nil ok, string? message, string? code  after its queued work
function Comm:destroy() end
---@return true|nil ok, string? message, string? code  without waiting (poison)
function Comm:abort() end
