"""Decoding-state checkpoints on disk: what one holds comes back whole, a request's checkpoint is
rewritten only when its tokens fill another block, and a truncated, corrupt, foreign or missing
file is a CheckpointError, never a crash."""

import os
from pathlib import Path

import pytest
import redis

from workers.engine import SamplingParams
from workers.engine.request import PENDING_TOKEN, Request
from workers.worker.checkpoints import (
    CheckpointError,
    Checkpoints,
    DirectoryStorage,
    RedisStorage,
    decode_checkpoint,
    decoding_state,
    encode_checkpoint,
)

BLOCK = 16


def request(request_id: str = "r#1", outputs: int = 3) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(20)),
        params=SamplingParams(temperature=0.7, seed=12345678901234567890, max_tokens=64),
        max_tokens=64,
        hash_extra=b"",
        output_token_ids=list(range(100, 100 + outputs)),
        num_cached_tokens=16,
    )


@pytest.fixture(params=["directory", "redis"])
def checkpoints(request, tmp_path: Path):
    """Checkpoints beside the block files, or in Redis (db 15, a prefix of this test's own)."""
    if request.param == "directory":
        yield Checkpoints(DirectoryStorage(tmp_path / "checkpoints"), block_tokens=BLOCK, kv_model_id="tiny:float32")
        return
    client = redis.Redis.from_url("redis://127.0.0.1:6379/15")
    prefix = f"sluice-migrate-test-{os.getpid()}"
    yield Checkpoints(RedisStorage(client, prefix), block_tokens=BLOCK, kv_model_id="tiny:float32")
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)


def test_a_checkpoint_holds_the_tokens_seed_and_params_of_its_request(checkpoints):
    running = request()
    running.output_token_ids.append(PENDING_TOKEN)  # sampled, not yet read: not part of the state
    checkpoints.save(running)

    state = checkpoints.read("r#1")

    assert state.prompt_token_ids == list(range(20)) and state.output_token_ids == [100, 101, 102]
    assert state.params.seed == 12345678901234567890 and state.params == running.params
    assert (state.num_cached_tokens, state.kv_model_id) == (16, "tiny:float32")


def test_a_request_is_checkpointed_again_only_when_its_tokens_fill_another_block(checkpoints):
    running = request(outputs=3)  # 23 tokens: one full block
    checkpoints.save(running)
    running.output_token_ids.extend([7, 8])  # 25: still one
    checkpoints.save_at_block_boundary(running)
    assert checkpoints.read("r#1").output_token_ids == [100, 101, 102]
    running.output_token_ids.extend([9] * 7)  # 32: two
    checkpoints.save_at_block_boundary(running)
    assert len(checkpoints.read("r#1").output_token_ids) == 12

    checkpoints.delete("r#1")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        checkpoints.read("r#1")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: data[:10], "truncated"),
        (lambda data: data[:-5], "header says"),
        (lambda data: data[:-1] + bytes([data[-1] ^ 1]), "checksum"),
        (lambda data: b"XXXX" + data[4:], "not a version"),
        (lambda data: os.urandom(len(data)), "not a version"),
    ],
)
def test_a_damaged_checkpoint_is_refused_with_what_is_wrong(damage, message):
    data = encode_checkpoint(decoding_state(request(), "tiny:float32"))
    with pytest.raises(CheckpointError, match=message):
        decode_checkpoint(damage(data), "r#1")


def test_a_checkpoint_of_another_request_is_refused(checkpoints):
    checkpoints.save(request("other#1"))
    data = checkpoints.storage.get(Checkpoints.name("other#1"))
    checkpoints.storage.put(Checkpoints.name("r#1"), data)  # under the wrong name

    with pytest.raises(CheckpointError, match="holds request 'other#1'"):
        checkpoints.read("r#1")
