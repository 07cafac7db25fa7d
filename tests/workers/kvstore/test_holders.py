"""One suite for every SWA holder index backend: MemoryHolders in process, RedisHolders on the real
Redis, and RemoteHolders talking to an IndexServer that serves holders beside its block index over a
real ipc socket; then what that server answers requests it cannot take."""

import shutil
import tempfile
import threading
from collections.abc import Iterator
from hashlib import blake2b

import msgspec
import pytest
import redis
import zmq

from tests.workers.kvstore.conftest import REDIS_URL
from workers.kvstore.holders import HolderIndex, MemoryHolders
from workers.kvstore.index_messages import KVHoldersLookup, KVHoldersRegister, KVIndexReply
from workers.kvstore.index_server import IndexServer
from workers.kvstore.memory_index import MemoryIndex
from workers.kvstore.redis_holders import RedisHolders
from workers.kvstore.remote_holders import RemoteHolders
from workers.kvstore.store import open_holders


def key(i: int) -> bytes:
    """Realistic keys: 16 random-looking bytes, glob characters included."""
    return blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


KEYS = [key(i) for i in range(10)]


class Served:
    """An IndexServer on a thread, serving `holders` beside an empty block index (ipc paths must be short)."""

    def __init__(self, holders: HolderIndex | None) -> None:
        self.directory = tempfile.mkdtemp(prefix="kvhold-")
        self.context = zmq.Context()
        self.stop = threading.Event()
        self.server = IndexServer(MemoryIndex(), f"ipc://{self.directory}/index", self.context, holders=holders)
        self.endpoint = self.server.endpoint
        self.thread = threading.Thread(target=self.server.serve, args=(self.stop,))
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.context.destroy(linger=0)
        shutil.rmtree(self.directory)


@pytest.fixture(params=["memory", "redis", "served"])
def make_holders(request, redis_prefix: str) -> Iterator:
    opened = []

    def make(max_per_worker: int = 1000) -> HolderIndex:
        if request.param == "memory":
            return MemoryHolders(max_per_worker)
        if request.param == "served":
            served = Served(MemoryHolders(max_per_worker))
            opened.append(served)
            return RemoteHolders(served.endpoint, context=served.context)
        client = redis.Redis.from_url(REDIS_URL)
        opened.append(client)
        return RedisHolders(client, redis_prefix, max_per_worker)

    yield make
    for thing in opened:
        thing.close()


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


def test_open_holders_follows_the_index_url(redis_prefix: str) -> None:
    assert isinstance(open_holders("memory"), MemoryHolders)
    assert isinstance(open_holders("ipc:///tmp/nowhere/index"), RemoteHolders)
    on_redis = open_holders(f"{REDIS_URL}?prefix={redis_prefix}")
    assert isinstance(on_redis, RedisHolders) and on_redis.prefix == f"{redis_prefix}:swa"
    on_redis.register(KEYS[:1], "w1")
    assert on_redis.holders(KEYS[:1]) == [{"w1"}]
    on_redis.client.close()
    with pytest.raises(ValueError, match="unknown KV index URL"):
        open_holders("tcp://127.0.0.1:7999")


def ask(endpoint: str, frame: bytes) -> KVIndexReply:
    with zmq.Context() as context, context.socket(zmq.DEALER) as dealer:
        dealer.connect(endpoint)
        dealer.send(frame)
        assert dealer.poll(10_000), "no reply"
        return msgspec.msgpack.decode(dealer.recv(), type=KVIndexReply)


def test_a_served_holder_request_it_cannot_take_gets_an_error_reply_and_the_server_goes_on() -> None:
    served = Served(MemoryHolders())
    try:
        ill_typed = ask(
            served.endpoint, msgspec.msgpack.encode({"type": "kv_holders.holders", "call_id": 3, "keys": 7})
        )
        no_worker = ask(served.endpoint, msgspec.msgpack.encode(KVHoldersRegister(5, KEYS[:1], "")))
        holders = RemoteHolders(served.endpoint, context=served.context)
        holders.register(KEYS[:1], "w1")
        assert holders.holders(KEYS[:1]) == [{"w1"}]
    finally:
        served.close()
    assert ill_typed.call_id == 0 and "invalid KV index request" in ill_typed.error and "keys" in ill_typed.error
    assert no_worker.call_id == 5
    assert no_worker.error == "KVHoldersRegister failed: a holder's worker_id is a non-empty string, got ''"


def test_a_server_without_holders_says_so() -> None:
    served = Served(None)
    try:
        reply = ask(served.endpoint, msgspec.msgpack.encode(KVHoldersLookup(4, KEYS[:1])))
    finally:
        served.close()
    assert reply.call_id == 4 and reply.error == "this index serves no SWA holders (KVHoldersLookup)"
