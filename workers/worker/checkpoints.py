"""Checkpoints of running requests' decoding state (protocol.DecodingState), one file per request in
a `checkpoints` folder beside the KV store's block files, so that another decode worker sharing the
store can continue a request whose worker died.

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

import msgspec

from workers.engine.request import Request
from workers.protocol import DecodingState

log = logging.getLogger(__name__)

MAGIC = b"SKVC"
VERSION = 1
CHECKSUM_BYTES = 16
SUFFIX = ".ckpt"
FOLDER = "checkpoints"
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


class Checkpoints:
    def __init__(self, root: Path, *, block_tokens: int, kv_model_id: str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.block_tokens = block_tokens
        self.kv_model_id = kv_model_id
        self._saved_blocks: dict[str, int] = {}  # request id → its tokens' full blocks at its last checkpoint

    def path(self, request_id: str) -> Path:
        # Hashed: a request id is the gateway's string, never a file name.
        return self.root / f"{hashlib.sha256(request_id.encode()).hexdigest()[:40]}{SUFFIX}"

    def save(self, request: Request) -> None:
        """Checkpoint the request now (when it is taken in)."""
        self._saved_blocks[request.request_id] = request.num_known_tokens // self.block_tokens
        self._write(request.request_id, encode_checkpoint(decoding_state(request, self.kv_model_id)))

    def save_at_block_boundary(self, request: Request) -> None:
        """Checkpoint the request if its tokens filled another store block since its last checkpoint."""
        blocks = request.num_known_tokens // self.block_tokens
        if blocks > self._saved_blocks.get(request.request_id, -1):
            self.save(request)

    def read(self, request_id: str) -> DecodingState:
        try:
            with open(self.path(request_id), "rb") as f:
                data = f.read(MAX_BYTES + 1)
        except FileNotFoundError:
            raise CheckpointError(f"no checkpoint of {request_id!r}") from None
        return decode_checkpoint(data, request_id)

    def delete(self, request_id: str) -> None:
        self._saved_blocks.pop(request_id, None)
        self.path(request_id).unlink(missing_ok=True)

    def _write(self, request_id: str, data: bytes) -> None:
        final = self.path(request_id)
        temp = final.with_name(f".{final.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            temp.write_bytes(data)
            os.replace(temp, final)
        except OSError:
            # A full or failing disk costs this request its failover, never its stream.
            temp.unlink(missing_ok=True)
            log.exception("writing the checkpoint of %s failed", request_id)
