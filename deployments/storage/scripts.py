"""The scenario store's Lua scripts (``deployments/storage/store.py``): every write is one of them, run atomically in Redis.

:data:`WRITE_SCRIPT` (put, patch, rollback, delete: section 4.1 of docs/design.md) and :data:`REMEMBER_SCRIPT` (the
answer of a request that wrote nothing, kept under its idempotency key), and the status codes they answer.

The keys they write (``P`` is the prefix, ``cs:`` by default; ``N`` a scenario name, ``n`` a version number)::

    P names              SET     names that currently exist (live)
    P all                SET     every name that was ever written (history survives a delete)
    P s:N:seq            STRING  last version number handed out for N (INCR)
    P s:N:current        STRING  version currently in force; absent while N is deleted
    P s:N:history        LIST    every version number of N, oldest first
    P s:N:bodies         LIST    the versions of N that still hold a body, oldest first (bounded history)
    P s:N:v:n            HASH    one version, written once; only pruning changes it later:
                                   version, action (put | patch | rollback | delete), created_at (ISO 8601 UTC),
                                   type and scenario (the body as JSON; not on a delete entry) or, for a body
                                   over BODY_INLINE_BYTES, body_sha256 (the body is stored content),
                                   from_version (rollback only), refs (the content SHA-256s it refers to),
                                   pruned (when its body was dropped: the instant; scenario/body_sha256/refs gone)
    P w:<id>             STRING  version made by the write call <id> (kept 1 hour): a retried call is applied once
    P i:<key>            HASH    an admin write made with the idempotency key <key> (kept ``idempotency_ttl_s``,
                                   24 h by default): fingerprint (of the request), action, name, version,
                                   from_version; a retry with the key is answered with this version
    P c:<sha256>:m       HASH    stored content (a tree file as read at the PUT, a catalog, a large body) under
                                   the SHA-256 (hex) of its bytes: size, chunks, encoding (zlib | zlib-parts | raw); content
                                   stored as a line delta (a catalog PATCH) also has base (the SHA-256 of the
                                   content it applies to) and chain (every base down to whole content, nearest
                                   first, comma separated): its chunks hold the delta, not the content
    P c:<sha256>:<i>     STRING  chunk i of that content (compressed), at most CHUNK_BYTES (1 MiB) each
    P c:<sha256>:s<i>    STRING  chunk i of content staged ahead of the write that names it (ScenarioStore.
                                   stage_content: an inline tree's catalog, the base of its first PATCH), with an
                                   expiry; that write renames them to P c:<sha256>:<i> and lifts it
    P c:<sha256>:refs    SET     the versions ("N:n") whose bodies refer to it, directly or as a base of the
                                   delta chain of the content they refer to (listed in the version's refs too);
                                   when pruning empties it, the content is removed
    P c:<sha256>         STRING  content written before chunking (one value; read, never written now)
    P changes            pub/sub channel: {"name", "version", "action"} after every write
"""

from __future__ import annotations

__all__ = ["BASE_CHANGED", "DROP_CHUNKS_SCRIPT", "KEY_REUSED", "NOT_LIVE", "NO_CONTENT", "REMEMBER_SCRIPT", "REPLAYED", "TOO_LATE",
           "WRITE_SCRIPT", "WRITTEN"]

# Script answers: {status, version}
WRITTEN, REPLAYED, NOT_LIVE, TOO_LATE, NO_CONTENT, KEY_REUSED, BASE_CHANGED = 1, 2, -1, -2, -3, -4, -5

WRITE_SCRIPT = """
-- KEYS: seq, current, history, names, all, write id, idempotency key, bodies
-- ARGV: version key prefix, name, action, created_at, type, body ('' when stored as content), from_version,
--       channel, deadline (ms), fingerprint ('' = no idempotency key), idempotency ttl (s),
--       content refs (JSON [[sha, manifest or false], ...]), content key prefix, expected current ('' = any),
--       bodies to keep (0 = all), body sha256 ('' = the body is inline), the write's answer ('' = none; JSON,
--       kept with the idempotency key so that a retry gets it)
local done = redis.call('GET', KEYS[6])
if done then
  return {1, tonumber(done)}  -- a retry of a write call that was applied: the same version, not a second one
end
local now = redis.call('TIME')
if tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) > tonumber(ARGV[9]) then
  return {-2, 0}  -- the writer has given up on this call (the server was hung): never apply it late
end
if ARGV[10] ~= '' then
  local seen = redis.call('HMGET', KEYS[7], 'fingerprint', 'version')
  if seen[1] then
    if seen[1] ~= ARGV[10] then
      return {-4, 0}  -- the key was used for another request
    end
    return {2, tonumber(seen[2])}  -- a retried request: its first result, nothing written again
  end
end
local name, action = ARGV[2], ARGV[3]
if action == 'delete' and redis.call('SISMEMBER', KEYS[4], name) == 0 then
  return {-1, 0}
end
if ARGV[14] ~= '' then
  local cur = redis.call('GET', KEYS[2])
  if cur ~= ARGV[14] then
    return {-5, tonumber(cur) or 0}  -- the scenario changed since the caller read it
  end
end
local cprefix = ARGV[13]
local refs = cjson.decode(ARGV[12])
-- the content this version refers to: each ref, and for content stored as a delta, every base of its chain (so
-- pruning never removes a base while a version still needs it); all of it must be stored before anything is written
local shas, seen, incoming = {}, {}, {}
for _, ref in ipairs(refs) do
  if ref[2] then
    incoming[ref[1]] = true  -- (written below, once every chunk is found there: a delta's base may be one)
  end
end
local function stored(sha)
  return incoming[sha] or redis.call('EXISTS', cprefix .. sha .. ':m') == 1 or redis.call('EXISTS', cprefix .. sha) == 1
end
for _, ref in ipairs(refs) do
  local sha, manifest = ref[1], ref[2]
  local chain = false
  if redis.call('EXISTS', cprefix .. sha .. ':m') == 1 then
    chain = redis.call('HGET', cprefix .. sha .. ':m', 'chain')  -- stored already (as a delta, or whole: false)
  elseif not manifest then
    if redis.call('EXISTS', cprefix .. sha) == 0 then
      return {-3, 0}
    end
  elseif manifest[5] then
    chain = manifest[5]  -- written below, as a delta of manifest[4]
  end
  if not seen[sha] then
    seen[sha] = true
    table.insert(shas, sha)
  end
  if chain then
    for one in string.gmatch(chain, '[^,]+') do
      if not stored(one) then
        return {-3, 0}  -- a base of the delta is gone (pruned meanwhile): the writer stores the whole content
      end
      if not seen[one] then
        seen[one] = true
        table.insert(shas, one)
      end
    end
  end
end
for _, ref in ipairs(refs) do
  local sha, manifest = ref[1], ref[2]
  if manifest and redis.call('EXISTS', cprefix .. sha .. ':m') == 0 then
    local part = manifest[6] or ''  -- ('s': content staged ahead, its chunks renamed below)
    for i = 0, tonumber(manifest[2]) - 1 do
      if redis.call('EXISTS', cprefix .. sha .. ':' .. part .. i) == 0 then
        return {-3, 0}  -- a chunk is gone (a refused write of the same content cleaned up, staged ones expired)
      end
    end
  end
end
for _, ref in ipairs(refs) do
  local sha, manifest = ref[1], ref[2]
  local staged = manifest and manifest[6]
  if staged and redis.call('EXISTS', cprefix .. sha .. ':m') == 1 then
    for i = 0, tonumber(manifest[2]) - 1 do  -- stored meanwhile by another write: the staged copy goes
      redis.call('UNLINK', cprefix .. sha .. ':' .. staged .. i)
    end
  elseif manifest and redis.call('EXISTS', cprefix .. sha .. ':m') == 0 then
    redis.call('HSET', cprefix .. sha .. ':m', 'size', manifest[1], 'chunks', manifest[2], 'encoding', manifest[3])
    if staged then  -- content staged ahead: its chunks take their place, kept for good
      for i = 0, tonumber(manifest[2]) - 1 do
        redis.call('RENAME', cprefix .. sha .. ':' .. staged .. i, cprefix .. sha .. ':' .. i)
        redis.call('PERSIST', cprefix .. sha .. ':' .. i)
      end
    end
    if manifest[4] then
      redis.call('HSET', cprefix .. sha .. ':m', 'base', manifest[4], 'chain', manifest[5])
    end
  end
end
local v, vkey
repeat
  v = redis.call('INCR', KEYS[1])
  vkey = ARGV[1] .. v
until redis.call('EXISTS', vkey) == 0
local fields = {'version', v, 'action', action, 'created_at', ARGV[4]}
if action ~= 'delete' then
  table.insert(fields, 'type'); table.insert(fields, ARGV[5])
  if ARGV[16] ~= '' then
    table.insert(fields, 'body_sha256'); table.insert(fields, ARGV[16])
  else
    table.insert(fields, 'scenario'); table.insert(fields, ARGV[6])
  end
end
if ARGV[7] ~= '' then
  table.insert(fields, 'from_version'); table.insert(fields, ARGV[7])
end
for _, sha in ipairs(shas) do
  redis.call('SADD', cprefix .. sha .. ':refs', name .. ':' .. v)
end
if #shas > 0 then
  table.insert(fields, 'refs'); table.insert(fields, table.concat(shas, ','))
end
redis.call('HSET', vkey, unpack(fields))
redis.call('RPUSH', KEYS[3], v)
redis.call('SADD', KEYS[5], name)
if action == 'delete' then
  redis.call('DEL', KEYS[2])
  redis.call('SREM', KEYS[4], name)
else
  redis.call('SET', KEYS[2], v)
  redis.call('SADD', KEYS[4], name)
  -- bounded history: the oldest bodies beyond the newest ARGV[15] are dropped, their metadata stays
  redis.call('RPUSH', KEYS[8], v)
  local keep = tonumber(ARGV[15])
  while keep > 0 and redis.call('LLEN', KEYS[8]) > keep do
    local old = redis.call('LPOP', KEYS[8])
    local okey = ARGV[1] .. old
    local oldrefs = redis.call('HGET', okey, 'refs')
    redis.call('HDEL', okey, 'scenario', 'body_sha256', 'refs')
    redis.call('HSET', okey, 'pruned', ARGV[4])
    if oldrefs then
      for sha in string.gmatch(oldrefs, '[^,]+') do
        local rkey = cprefix .. sha .. ':refs'
        if redis.call('SREM', rkey, name .. ':' .. old) == 1 and redis.call('SCARD', rkey) == 0 then
          local chunks = tonumber(redis.call('HGET', cprefix .. sha .. ':m', 'chunks') or '0')
          for i = 0, chunks - 1 do
            redis.call('UNLINK', cprefix .. sha .. ':' .. i)
          end
          local wchunks = tonumber(redis.call('HGET', cprefix .. sha .. ':m', 'wchunks') or '0')
          for i = 0, wchunks - 1 do  -- (the whole bytes a compaction stored beside a delta)
            redis.call('UNLINK', cprefix .. sha .. ':w' .. i)
          end
          redis.call('UNLINK', cprefix .. sha .. ':m', rkey)
        end
      end
    end
  end
end
redis.call('SET', KEYS[6], v, 'EX', 3600)
if ARGV[10] ~= '' then
  redis.call('HSET', KEYS[7], 'fingerprint', ARGV[10], 'action', action, 'name', name, 'version', v,
             'from_version', ARGV[7], 'answer', ARGV[17])
  redis.call('EXPIRE', KEYS[7], tonumber(ARGV[11]))
end
redis.call('PUBLISH', ARGV[8], cjson.encode({name = name, version = v, action = action}))
return {1, v}
"""

# KEYS: idempotency key; ARGV: fingerprint, action, name, version, answer (JSON), ttl (s). A request that wrote
# nothing keeps its answer under its key, unless the key already holds a record (then: reused, or the same request).
REMEMBER_SCRIPT = """
local seen = redis.call('HGET', KEYS[1], 'fingerprint')
if seen then
  if seen ~= ARGV[1] then
    return -4
  end
  return 2
end
redis.call('HSET', KEYS[1], 'fingerprint', ARGV[1], 'action', ARGV[2], 'name', ARGV[3], 'version', ARGV[4],
           'from_version', '', 'answer', ARGV[5])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[6]))
return 1
"""


DROP_CHUNKS_SCRIPT = """
-- KEYS: the content key (P c:<sha>); ARGV: chunk count
-- The chunks a refused write uploaded, removed unless a manifest names them (another write stored that content):
-- a write that uploaded the same chunks and has not run yet finds one missing and uploads again (WRITE_SCRIPT).
if redis.call('EXISTS', KEYS[1] .. ':m') == 1 then
  return 0
end
local n = 0
for i = 0, tonumber(ARGV[1]) - 1 do
  n = n + redis.call('DEL', KEYS[1] .. ':' .. i)
end
return n
"""


WHOLE_SCRIPT = """
-- KEYS: the content's manifest key (P c:<sha>:m); ARGV: size, chunk count, encoding, chunk key prefix (P c:<sha>:w)
-- The whole bytes of content stored as a delta, uploaded beside it (ScenarioStore's compaction behind the writes)
-- with an expiry, named in its manifest and persisted: readers and the next delta then start from them. Content
-- pruned meanwhile (no manifest): the chunks are removed again. A chunk gone (expired): nothing named, 0.
if redis.call('EXISTS', KEYS[1]) == 0 then
  for i = 0, tonumber(ARGV[2]) - 1 do
    redis.call('UNLINK', ARGV[4] .. i)
  end
  return 0
end
for i = 0, tonumber(ARGV[2]) - 1 do
  if redis.call('EXISTS', ARGV[4] .. i) == 0 then
    return 0
  end
end
for i = 0, tonumber(ARGV[2]) - 1 do
  redis.call('PERSIST', ARGV[4] .. i)
end
redis.call('HSET', KEYS[1], 'wsize', ARGV[1], 'wchunks', ARGV[2], 'wencoding', ARGV[3])
return 1
"""
