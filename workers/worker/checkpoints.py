"""Checkpoints of running requests' decoding state (protocol.DecodingState), kept where the KV store's
index is, so that another decode worker sharing the store can continue a request whose worker died:
with the Redis index, in Redis (a key per request beside the index's, expiring after CHECKPOINT_TTL_S);
otherwise one file per request in a `checkpoints` folder beside the block files, which the store's
GC deletes CHECKPOINT_TTL_S after its last write (workers.kvstore.checkpoint_files).

A decode worker writes a request's checkpoint when it takes the request in and again each time the
request's tokens fill a store block, and deletes it when the request ends here. Files are written
to a temp name and renamed into place, so a reader sees a whole checkpoint or none; each is
checksummed, and a reader trusts nothing in it: a missing, truncated, corrupt or foreign file is a
CheckpointError, and the caller falls back to rerunning the request.

File layout: magic "SKVC" | version u16 | length u32 | SHA-256 of the body (first 16 bytes) | body,
the msgpack of the DecodingState.
"""

import hashlib
import logging
import os
import secrets
import struct
from pathlib import Path
from typing import Protocol

import msgspec

from workers.engine.request import Request
from workers.kvstore.checkpoint_files import CHECKPOINT_TTL_S, SUFFIX
from workers.protocol.messages import DecodingState

log = logging.getLogger(__name__)

MAGIC = b"SKVC"
VERSION = 1
CHECKSUM_BYTES = 16
# A checkpoint is a few ints per token: even a full 128K-token context stays well under this.
MAX_BYTES = 16 << 20

_FIXED = struct.Struct(f"<4sHI{CHECKSUM_BYTES}s")
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(DecodingState).decode


class CheckpointError(Exception):
    """A checkpoint that cannot be used: the message says why."""


def decoding_state(request: Request, kv_model_id: str) -> DecodingState:
    return DecodingState(
        version=VERSION,
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        output_token_ids=[token for token in request.output_token_ids if token >= 0],
        params=request.params,
        cache_namespace=request.cache_namespace,
        traffic_class=request.traffic_class,
        num_cached_tokens=request.num_cached_tokens,
        kv_model_id=kv_model_id,
    )


def encode_checkpoint(state: DecodingState) -> bytes:
    body = _encode(state)
    return _FIXED.pack(MAGIC, VERSION, len(body), hashlib.sha256(body).digest()[:CHECKSUM_BYTES]) + body


def decode_checkpoint(data: bytes, request_id: str) -> DecodingState:
    """The state in a checkpoint file's bytes, checked to be whole and `request_id`'s."""
    if len(data) < _FIXED.size:
        raise CheckpointError(f"checkpoint of {request_id!r} is truncated ({len(data)} bytes)")
    magic, version, length, checksum = _FIXED.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise CheckpointError(f"checkpoint of {request_id!r} is not a version {VERSION} checkpoint")
    body = memoryview(data)[_FIXED.size :]
    if len(body) != length:
        raise CheckpointError(f"checkpoint of {request_id!r} has {len(body)} bytes of state, its header says {length}")
    if hashlib.sha256(body).digest()[:CHECKSUM_BYTES] != checksum:
        raise CheckpointError(f"checkpoint of {request_id!r} fails its checksum")
    try:
        state = _decode(body)
    except msgspec.DecodeError as error:
        raise CheckpointError(f"checkpoint of {request_id!r} is unreadable: {error}") from None
    if state.version != VERSION or state.request_id != request_id:
        raise CheckpointError(f"checkpoint file of {request_id!r} holds request {state.request_id!r}")
    return state


class CheckpointStorage(Protocol):
    """Where checkpoints' bytes live, by a name derived from the request id."""

    def put(self, name: str, data: bytes) -> None: ...

    def get(self, name: str) -> bytes | None: ...

    def delete(self, name: str) -> None: ...


class DirectoryStorage:
    """One file per checkpoint in `root`, written atomically."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        return self.root / f"{name}{SUFFIX}"

    def put(self, name: str, data: bytes) -> None:
        final = self.path(name)
        temp = final.with_name(f".{final.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            temp.write_bytes(data)
            os.replace(temp, final)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    def get(self, name: str) -> bytes | None:
        try:
            with open(self.path(name), "rb") as f:
                return f.read(MAX_BYTES + 1)
        except FileNotFoundError:
            return None

    def delete(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)


class RedisStorage:
    """A key per checkpoint, `<prefix>:ckpt:<name>`, expiring after CHECKPOINT_TTL_S."""

    def __init__(self, client, prefix: str) -> None:
        self.client = client
        self.prefix = f"{prefix}:ckpt:"

    def put(self, name: str, data: bytes) -> None:
        self.client.set(self.prefix + name, data, ex=CHECKPOINT_TTL_S)

    def get(self, name: str) -> bytes | None:
        return self.client.get(self.prefix + name)

    def delete(self, name: str) -> None:
        self.client.delete(self.prefix + name)


class Checkpoints:
    def __init__(self, storage: CheckpointStorage, *, block_tokens: int, kv_model_id: str) -> None:
        self.storage = storage
        self.block_tokens = block_tokens
        self.kv_model_id = kv_model_id
        self._saved_blocks: dict[str, int] = {}  # request id → its tokens' full blocks at its last checkpoint

    @staticmethod
    def name(request_id: str) -> str:
        # Hashed: a request id is the gateway's string, never a file name or a key of its own.
        return hashlib.sha256(request_id.encode()).hexdigest()[:40]

    def save(self, request: Request) -> None:
        """Checkpoint the request now (when it is taken in)."""
        self._saved_blocks[request.request_id] = request.num_known_tokens // self.block_tokens
        data = encode_checkpoint(decoding_state(request, self.kv_model_id))
        try:
            self.storage.put(self.name(request.request_id), data)
        except Exception:
            # A full disk or an unreachable Redis costs this request its failover, never its stream.
            log.exception("writing the checkpoint of %s failed", request.request_id)

    def save_at_block_boundary(self, request: Request) -> None:
        """Checkpoint the request if its tokens filled another store block since its last checkpoint."""
        blocks = request.num_known_tokens // self.block_tokens
        if blocks > self._saved_blocks.get(request.request_id, -1):
            self.save(request)

    def read(self, request_id: str) -> DecodingState:
        try:
            data = self.storage.get(self.name(request_id))
        except Exception as error:
            raise CheckpointError(f"reading the checkpoint of {request_id!r} failed: {error}") from None
        if data is None:
            raise CheckpointError(f"no checkpoint of {request_id!r}")
        return decode_checkpoint(data, request_id)

    def delete(self, request_id: str) -> None:
        self._saved_blocks.pop(request_id, None)
        try:
            self.storage.delete(self.name(request_id))
        except Exception:
            log.warning("deleting the checkpoint of %s failed", request_id, exc_info=True)
