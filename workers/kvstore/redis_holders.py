"""The SWA holder index on Redis (workers.kvstore.holders): shared by every process and host of a cluster,
beside the block index (workers.kvstore.redis_index) on the same Redis.

Layout, every key under `prefix`:

    <prefix>:k:<16-byte key>   set: the workers that hold the block            (one per block held)
    <prefix>:w:<worker id>     sorted set: the worker's blocks scored by registration number
    <prefix>:seq               the last registration number

Every write is one Lua script, so the two sides never disagree: a block's set names a worker exactly
when the worker's sorted set holds the block. A lookup is one pipelined round trip.
"""

from collections.abc import Sequence

import redis

from workers.kvstore.block_hash import BlockHash
from workers.kvstore.holders import MAX_PER_WORKER, HolderIndex, check_max_per_worker, check_worker_id

_REGISTER = """
local prefix, worker, cap = ARGV[1], ARGV[2], tonumber(ARGV[3])
local held = prefix .. ':w:' .. worker
local seq = redis.call('INCRBY', prefix .. ':seq', #ARGV - 3) - (#ARGV - 3)
for i = 4, #ARGV do
  redis.call('ZADD', held, seq + i - 3, ARGV[i])
  redis.call('SADD', prefix .. ':k:' .. ARGV[i], worker)
end
local excess = redis.call('ZCARD', held) - cap
if excess > 0 then
  local oldest = redis.call('ZPOPMIN', held, excess)
  for i = 1, #oldest, 2 do
    redis.call('SREM', prefix .. ':k:' .. oldest[i], worker)
  end
end
"""

_DROP = """
local prefix, worker = ARGV[1], ARGV[2]
local held = prefix .. ':w:' .. worker
for i = 3, #ARGV do
  if redis.call('ZREM', held, ARGV[i]) == 1 then
    redis.call('SREM', prefix .. ':k:' .. ARGV[i], worker)
  end
end
"""

_DROP_WORKER = """
local prefix, worker = ARGV[1], ARGV[2]
local held = prefix .. ':w:' .. worker
local keys = redis.call('ZRANGE', held, 0, -1)
for _, key in ipairs(keys) do
  redis.call('SREM', prefix .. ':k:' .. key, worker)
end
redis.call('DEL', held)
return #keys
"""


class RedisHolders(HolderIndex):
    def __init__(self, client: redis.Redis, prefix: str = "sluice:swa", max_per_worker: int = MAX_PER_WORKER) -> None:
        self.max_per_worker = check_max_per_worker(max_per_worker)
        if client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ValueError("RedisHolders needs a client with decode_responses=False: block keys are raw bytes")
        self.client = client
        self.prefix = prefix
        self._key_prefix = f"{prefix}:k:".encode()
        self._register = client.register_script(_REGISTER)
        self._drop = client.register_script(_DROP)
        self._drop_worker = client.register_script(_DROP_WORKER)

    def register(self, keys: Sequence[BlockHash], worker_id: str) -> None:
        if keys:
            self._register(args=[self.prefix, check_worker_id(worker_id), self.max_per_worker, *keys])

    def drop(self, keys: Sequence[BlockHash], worker_id: str) -> None:
        if keys:
            self._drop(args=[self.prefix, worker_id, *keys])

    def drop_worker(self, worker_id: str) -> int:
        return int(self._drop_worker(args=[self.prefix, worker_id]))

    def holders(self, keys: Sequence[BlockHash]) -> list[set[str]]:
        if not keys:
            return []
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.smembers(self._key_prefix + key)
        return [{worker.decode() for worker in workers} for workers in pipe.execute()]
