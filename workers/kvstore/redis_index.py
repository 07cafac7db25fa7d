"""The block index on Redis: one index shared by every process and host that uses the store.

Layout, every key under `prefix` (tests use a unique prefix and delete it afterwards):

    <prefix>:e:<16-byte key>   hash: size, class, depth, created, last, hits, retain, newchain,
                               before                                          (one per block)
    <prefix>:lru:<class>       sorted set: block key scored by last access     (the expiry query)
    <prefix>:usage             hash: blocks, bytes                             (exact totals)
    <prefix>:classes           hash: class -> number of blocks                 (classes in use)
    <prefix>:gone              hash: evicted block key -> its uses             (remembered evictions)
    <prefix>:gone:order        sorted set: evicted block key scored by eviction number (oldest first)
    <prefix>:gone:seq          the last eviction number

An entry is a Redis hash rather than msgpack so that a touch can update last access and the hit
count in place, inside a script, without decoding. Floats travel as Python's repr, which round-trips
exactly; a touch writes the caller's string back rather than a Lua number (Lua would print 14 digits).

Every write is one Lua script, so it is atomic: concurrent adds of the same key insert it once and
the totals never drift. A prefix match is one script too: it walks the chain in Redis and stops at
the first absent key, one round trip for any chain length. Scripts build key names from the prefix,
which a single Redis (or a primary with replicas) allows; Redis Cluster would need declared keys.

The client must return bytes (redis-py's default, `decode_responses=False`): block keys are raw bytes.
"""

import math
import re
from collections.abc import Iterator, Sequence

import redis

from workers.kvstore.block_hash import BlockHash
from workers.kvstore.index import REMEMBERED_PER_BLOCK, BlockEntry, BlockIndex, IndexUsage

_FIELDS = ("size", "class", "depth", "created", "last", "hits", "retain", "newchain", "before")
_SCAN_BATCH = 1000

_ADD = """
local prefix = ARGV[1]
local usage, classes = prefix .. ':usage', prefix .. ':classes'
local gone, gone_order = prefix .. ':gone', prefix .. ':gone:order'
local added = 0
for i = 2, #ARGV, 10 do
  local key, size, class, last = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 5]
  local entry = prefix .. ':e:' .. key
  if redis.call('EXISTS', entry) == 0 then
    local before = tonumber(ARGV[i + 9])
    local remembered = redis.call('HGET', gone, key)
    if remembered then
      before = before + tonumber(remembered)
      redis.call('HDEL', gone, key)
      redis.call('ZREM', gone_order, key)
    end
    redis.call('HSET', entry, 'size', size, 'class', class, 'depth', ARGV[i + 3], 'created', ARGV[i + 4],
               'last', last, 'hits', ARGV[i + 6], 'retain', ARGV[i + 7], 'newchain', ARGV[i + 8],
               'before', before)
    redis.call('ZADD', prefix .. ':lru:' .. class, last, key)
    redis.call('HINCRBY', usage, 'blocks', 1)
    redis.call('HINCRBY', usage, 'bytes', size)
    redis.call('HINCRBY', classes, class, 1)
    added = added + 1
  end
end
return added
"""

_TOUCH = """
local prefix, now = ARGV[1], ARGV[2]
for i = 3, #ARGV do
  local key = ARGV[i]
  local entry = prefix .. ':e:' .. key
  local class_last = redis.call('HMGET', entry, 'class', 'last')
  if class_last[1] then
    if tonumber(now) > tonumber(class_last[2]) then
      redis.call('HSET', entry, 'last', now)
      redis.call('ZADD', prefix .. ':lru:' .. class_last[1], now, key)
    end
    redis.call('HINCRBY', entry, 'hits', 1)
  end
end
"""

_RETAIN = """
local prefix, retain_until = ARGV[1], ARGV[2]
for i = 3, #ARGV do
  local entry = prefix .. ':e:' .. ARGV[i]
  if redis.call('EXISTS', entry) == 1 then
    local current = redis.call('HGET', entry, 'retain')
    if not current or tonumber(retain_until) > tonumber(current) then
      redis.call('HSET', entry, 'retain', retain_until)
    end
  end
end
"""

_REMOVE = """
local prefix, remember, per_block = ARGV[1], ARGV[2] == '1', tonumber(ARGV[3])
local usage, classes = prefix .. ':usage', prefix .. ':classes'
local gone, gone_order = prefix .. ':gone', prefix .. ':gone:order'
local removed = {}
for i = 4, #ARGV do
  local key = ARGV[i]
  local entry = prefix .. ':e:' .. key
  local v = redis.call('HMGET', entry, 'size', 'class', 'depth', 'created', 'last', 'hits', 'retain', 'newchain',
                       'before')
  if v[1] then
    redis.call('DEL', entry)
    redis.call('ZREM', prefix .. ':lru:' .. v[2], key)
    redis.call('HINCRBY', usage, 'blocks', -1)
    redis.call('HINCRBY', usage, 'bytes', '-' .. v[1])
    if redis.call('HINCRBY', classes, v[2], -1) <= 0 then
      redis.call('HDEL', classes, v[2])
    end
    removed[#removed + 1] = {key, v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9]}
    if remember then
      redis.call('HSET', gone, key, tonumber(v[9] or 0) + 1 + tonumber(v[6]))
      redis.call('ZADD', gone_order, redis.call('INCR', prefix .. ':gone:seq'), key)
    end
  end
end
local excess = redis.call('ZCARD', gone_order) - per_block * tonumber(redis.call('HGET', usage, 'blocks') or 0)
if excess > 0 then
  for _, key in ipairs(redis.call('ZPOPMIN', gone_order, excess)) do
    redis.call('HDEL', gone, key)
  end
end
return removed
"""

_MATCH_PREFIX = """
local prefix = ARGV[1] .. ':e:'
for i = 2, #ARGV do
  if redis.call('EXISTS', prefix .. ARGV[i]) == 0 then
    return i - 2
  end
end
return #ARGV - 1
"""

_EXPIRED = """
local prefix, lru, cutoff, limit = ARGV[1], ARGV[1] .. ':lru:' .. ARGV[2], ARGV[3], tonumber(ARGV[4])
local now = ARGV[5] == 'inf' and math.huge or tonumber(ARGV[5])
local found, offset = {}, 0
while #found < limit do
  local keys = redis.call('ZRANGEBYSCORE', lru, '-inf', cutoff, 'LIMIT', offset, limit)
  for _, key in ipairs(keys) do
    local v = redis.call('HMGET', prefix .. ':e:' .. key, 'size', 'class', 'depth', 'created', 'last', 'hits', 'retain',
                         'newchain', 'before')
    if not v[7] or tonumber(v[7]) <= now then
      found[#found + 1] = {key, v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9]}
      if #found >= limit then
        return found
      end
    end
  end
  if #keys < limit then
    return found
  end
  offset = offset + limit
end
return found
"""


class RedisIndex(BlockIndex):
    def __init__(self, client: redis.Redis, prefix: str = "sluice:kv") -> None:
        if client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("RedisIndex needs a client with decode_responses=False: block keys are raw bytes")
        self.client = client
        self.prefix = prefix
        self._entry_prefix = f"{prefix}:e:".encode()
        self._usage_key = f"{prefix}:usage"
        self._classes_key = f"{prefix}:classes"
        self._add = client.register_script(_ADD)
        self._touch = client.register_script(_TOUCH)
        self._retain = client.register_script(_RETAIN)
        self._remove = client.register_script(_REMOVE)
        self._match_prefix = client.register_script(_MATCH_PREFIX)
        self._expired = client.register_script(_EXPIRED)

    def add(self, entries: Sequence[BlockEntry]) -> int:
        if not entries:
            return 0
        args: list[bytes | str | int] = [self.prefix]
        for e in entries:
            args += [
                e.key,
                e.size,
                e.traffic_class,
                e.depth,
                repr(e.created_at),
                repr(e.last_access),
                e.hit_count,
                repr(e.retain_until),
                int(e.new_chain),
                e.uses_before,
            ]
        return int(self._add(args=args))

    def get(self, key: BlockHash) -> BlockEntry | None:
        values = self.client.hmget(self._entry_prefix + key, _FIELDS)
        return None if values[0] is None else _entry(key, values)

    def match_prefix(self, keys: Sequence[BlockHash]) -> int:
        if not keys:
            return 0
        return int(self._match_prefix(args=[self.prefix, *keys]))

    def contains_many(self, keys: Sequence[BlockHash]) -> list[bool]:
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._entry_prefix + key)
        return [bool(found) for found in pipe.execute()]

    def touch(self, keys: Sequence[BlockHash], now: float) -> None:
        if keys:
            self._touch(args=[self.prefix, repr(now), *keys])

    def retain(self, keys: Sequence[BlockHash], until: float) -> None:
        if keys:
            self._retain(args=[self.prefix, repr(until), *keys])

    def remove(self, keys: Sequence[BlockHash], *, remember: bool = False) -> list[BlockEntry]:
        """One script: the entries go, and with `remember` their uses are kept and the oldest
        remembered beyond the cap forgotten, atomically with the removal."""
        if not keys:
            return []
        rows = self._remove(args=[self.prefix, int(remember), REMEMBERED_PER_BLOCK, *keys])
        return [_entry(row[0], row[1:]) for row in rows]

    def expired(self, traffic_class: str, cutoff: float, limit: int, *, now: float = math.inf) -> list[BlockEntry]:
        """Retained entries are skipped inside the script, a page of `limit` at a time, so a class
        whose oldest entries are all retained still yields the expired ones behind them."""
        if limit <= 0:
            return []
        rows = self._expired(args=[self.prefix, traffic_class, repr(cutoff), limit, repr(now)])
        return [_entry(row[0], row[1:]) for row in rows]

    def entries(self) -> Iterator[BlockEntry]:
        """Entries found by SCAN, fetched a batch per round trip; an entry removed meanwhile is skipped."""
        pattern = re.sub(rb"([*?\[\]\\])", rb"\\\1", self._entry_prefix) + b"*"
        seen: set[bytes] = set()
        batch: list[bytes] = []
        for name in self.client.scan_iter(match=pattern, count=_SCAN_BATCH):
            if name not in seen:
                seen.add(name)
                batch.append(name)
            if len(batch) >= _SCAN_BATCH:
                yield from self._fetch(batch)
                batch = []
        yield from self._fetch(batch)

    def usage(self) -> IndexUsage:
        blocks, num_bytes = self.client.hmget(self._usage_key, ("blocks", "bytes"))
        return IndexUsage(num_blocks=int(blocks or 0), num_bytes=int(num_bytes or 0))

    def traffic_classes(self) -> set[str]:
        return {name.decode() for name in self.client.hkeys(self._classes_key)}

    def _fetch(self, names: list[bytes]) -> Iterator[BlockEntry]:
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.hmget(name, _FIELDS)
        for name, values in zip(names, pipe.execute()):
            if values[0] is not None:
                yield _entry(name[len(self._entry_prefix) :], values)


def _entry(key: bytes, values: Sequence[bytes]) -> BlockEntry:
    """An entry from the hash fields in `_FIELDS` order."""
    size, traffic_class, depth, created, last, hits, retain, new_chain, before = values
    return BlockEntry(
        key=key,
        size=int(size),
        traffic_class=traffic_class.decode(),
        depth=int(depth),
        created_at=float(created),
        last_access=float(last),
        hit_count=int(hits),
        # Absent in entries written before these fields existed.
        retain_until=float(retain) if retain is not None else 0.0,
        new_chain=new_chain == b"1",
        uses_before=int(before) if before is not None else 0,
    )
