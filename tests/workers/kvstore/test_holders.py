"""One suite for every SWA holder index backend: MemoryHolders in process and RedisHolders on the real
Redis."""

from collections.abc import Iterator
from hashlib import blake2b

import pytest
import redis

from tests.workers.kvstore.conftest import REDIS_URL
from workers.kvstore.holders import HolderIndex, MemoryHolders
from workers.kvstore.redis_holders import RedisHolders


def key(i: int) -> bytes:
    """Realistic keys: 16 random-looking bytes, glob characters included."""
    return blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


KEYS = [key(i) for i in range(10)]


@pytest.fixture(params=["memory", "redis"])
def make_holders(request, redis_prefix: str) -> Iterator:
    clients = []

    def make(max_per_worker: int = 1000) -> HolderIndex:
        if request.param == "memory":
            return MemoryHolders(max_per_worker)
        client = redis.Redis.from_url(REDIS_URL)
        clients.append(client)
        return RedisHolders(client, redis_prefix, max_per_worker)

    yield make
    for client in clients:
        client.close()


def test_registered_blocks_name_their_holders(make_holders) -> None:
    holders = make_holders()
    holders.register(KEYS[:3], "w1")
    holders.register(KEYS[1:4], "w2")
    assert holders.holders(KEYS[:5]) == [{"w1"}, {"w1", "w2"}, {"w1", "w2"}, {"w2"}, set()]
    assert holders.holders([]) == []


def test_holders_of_all_is_who_holds_every_block_of_a_window(make_holders) -> None:
    holders = make_holders()
    holders.register(KEYS[:3], "w1")
    holders.register(KEYS[1:4], "w2")
    assert holders.holders_of_all(KEYS[1:3]) == {"w1", "w2"}
    assert holders.holders_of_all(KEYS[0:3]) == {"w1"}
    assert holders.holders_of_all(KEYS[0:4]) == set()
    assert holders.holders_of_all([]) == set()


def test_a_drop_removes_only_that_workers_registrations(make_holders) -> None:
    holders = make_holders()
    holders.register(KEYS[:3], "w1")
    holders.register(KEYS[:3], "w2")
    holders.drop([KEYS[0], KEYS[1], KEYS[7]], "w1")
    holders.drop([KEYS[2]], "nobody")
    assert holders.holders(KEYS[:3]) == [{"w2"}, {"w2"}, {"w1", "w2"}]


def test_a_dead_workers_registrations_all_go_at_once(make_holders) -> None:
    holders = make_holders()
    holders.register(KEYS[:4], "dead")
    holders.register(KEYS[2:5], "alive")
    assert holders.drop_worker("dead") == 4
    assert holders.holders(KEYS[:5]) == [set(), set(), {"alive"}, {"alive"}, {"alive"}]
    assert holders.drop_worker("dead") == 0
    holders.register(KEYS[:1], "dead")  # a restarted worker registers again
    assert holders.holders(KEYS[:1]) == [{"dead"}]


def test_past_its_cap_a_workers_oldest_registrations_go(make_holders) -> None:
    holders = make_holders(max_per_worker=3)
    holders.register(KEYS[:3], "w1")
    holders.register(KEYS[:1], "w1")  # registered again: now its newest
    holders.register(KEYS[3:5], "w1")
    holders.register(KEYS[:5], "w2")
    assert holders.holders(KEYS[:5]) == [{"w1"}, set(), {"w2"}, {"w1", "w2"}, {"w1", "w2"}]
    assert holders.drop_worker("w1") == 3


def test_a_worker_id_is_a_non_empty_string(make_holders) -> None:
    holders = make_holders()
    with pytest.raises(ValueError, match="worker_id"):
        holders.register(KEYS[:1], "")
    with pytest.raises(ValueError, match="max_per_worker"):
        make_holders(max_per_worker=0)


def test_redis_holders_need_raw_bytes() -> None:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    with pytest.raises(ValueError, match="decode_responses"):
        RedisHolders(client, "x")
    client.close()
