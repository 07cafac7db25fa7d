"""The engine asks the store which blocks it holds once per step: one Redis round trip for all of
them (counted at the socket: each round trip sends one packed command), and the memory index with
its fallback to the block files answers the same."""

import uuid
from collections.abc import Iterator
from hashlib import blake2b
from pathlib import Path

import pytest
import redis
import redis.connection

from workers.kvstore.store import open_store

REDIS_URL = "redis://127.0.0.1:6379/13"


def key(i: int) -> bytes:
    return blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


@pytest.fixture
def redis_url() -> Iterator[str]:
    prefix = f"test:sluice:kv:{uuid.uuid4().hex}"
    yield f"{REDIS_URL}?prefix={prefix}"
    client = redis.Redis.from_url(REDIS_URL)
    if names := list(client.scan_iter(match=f"{prefix}:*", count=1000)):
        client.delete(*names)
    client.close()


def test_contains_many_on_redis_is_one_round_trip(tmp_path: Path, redis_url: str, monkeypatch) -> None:
    store = open_store(tmp_path, redis_url)
    for i in (0, 2, 5):
        store.write(key(i), b"x" * 64, depth=i, traffic_class="chat")
    sends = []
    send = redis.connection.AbstractConnection.send_packed_command
    monkeypatch.setattr(
        redis.connection.AbstractConnection,
        "send_packed_command",
        lambda self, *args, **kwargs: sends.append(1) or send(self, *args, **kwargs),
    )

    present = store.contains_many([key(i) for i in range(40)])

    assert present == [i in (0, 2, 5) for i in range(40)]
    assert len(sends) == 1


def test_contains_many_with_the_memory_index_finds_blocks_other_processes_wrote(tmp_path: Path) -> None:
    mine, other = open_store(tmp_path), open_store(tmp_path)
    mine.write(key(1), b"a" * 64, depth=0, traffic_class="chat")
    other.write(key(2), b"b" * 64, depth=1, traffic_class="chat")

    assert mine.contains_many([key(1), key(2), key(3)]) == [True, True, False]
    assert mine.contains_many([]) == []
