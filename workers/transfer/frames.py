"""The wire format of KV transfers: a KVHandoff sent from a prefill worker to a decode worker over ZMQ
as frames through host memory, and rebuilt there; and the one-message offer of its pages instead
(workers.transfer.pools), whose header describes the request as a frames header does.

Wire format (structs in workers.protocol, "KV transfer"): one multipart message per chunk of
`chunk_layers` layers, [KVTransferHeader, layer frames] first and [KVTransferChunk, layer frames]
after. Chunks are separate messages because ZMQ delivers a multipart message only whole: this way
the receiver holds layer 0 while later layers are still being copied out of the sender's pages.
Layer frames leave zero-copy (ZMQ keeps a reference to the tensor's buffer until it is sent) and
arrive as views of the received frames when those are writable and aligned (zmq.Frame buffers are).

The receiver trusts nothing in a transfer: every count, length, dtype and shape is checked before a
byte is interpreted, and any mismatch raises KVTransferError and drops that transfer's partial
state, so a malformed or truncated transfer costs that one request only. The header names the KV's
layout (KVCacheSpecs.layout), and a receiver that knows its cache's refuses another there, before a
byte of KV is taken in. Both ends must share byte
order (every host we run on is little-endian).
"""

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch
import zmq

from workers.engine.dtypes import KV_STORAGE_DTYPES
from workers.engine.kv_handoff import KVHandoff
from workers.protocol.messages import KVPoolOffer, KVTransferChunk, KVTransferHeader, KVTransferMessage

# The KV dtypes a transfer may name (those the engine runs in, and uint8 for an FP8 cache's rows);
# anything else is refused before it is interpreted.
DTYPES: dict[str, torch.dtype] = KV_STORAGE_DTYPES
# A header's layout string longer than this is refused unread (a layout names a few groups in a line).
MAX_LAYOUT_CHARS = 1024
# Transfers a receiver assembles at once; a header past this is refused (bounds memory held by
# senders that died mid-transfer; HandoffAssembler.discard drops one explicitly).
MAX_PARTIAL_TRANSFERS = 64

Frame = zmq.Frame | bytes | bytearray | memoryview

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVTransferMessage)


class KVTransferError(Exception):
    """A transfer that cannot be assembled; `request_id` names it when the frames said which."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message if request_id is None else f"KV transfer {request_id!r}: {message}")
        self.request_id = request_id


def transfer_header(handoff: KVHandoff, *, chunk_layers: int = 1, pool: KVPoolOffer | None = None) -> KVTransferHeader:
    """The header of a handoff's transfer: of its frames, or (`pool` given) of an offer of its pages."""
    if chunk_layers < 1:
        raise ValueError(f"chunk_layers must be >= 1, got {chunk_layers}")
    dtype = next((name for name, value in DTYPES.items() if value == handoff.kv_dtype), None)
    if dtype is None:
        raise ValueError(f"KV dtype {handoff.kv_dtype} cannot be transferred; allowed: {sorted(DTYPES)}")
    return KVTransferHeader(
        request_id=handoff.request_id,
        prompt_token_ids=handoff.prompt_token_ids,
        output_token_ids=handoff.output_token_ids,
        params=handoff.params,
        num_computed_tokens=handoff.num_computed_tokens,
        num_cached_tokens=handoff.num_cached_tokens,
        traffic_class=handoff.traffic_class,
        cache_namespace=handoff.cache_namespace,
        kv_model_id=handoff.kv_model_id,
        dtype=dtype,
        kv_layout=handoff.kv_layout,
        layer_shape=handoff.layer_shape,
        num_layers=handoff.num_layers,
        chunk_layers=chunk_layers,
        migrated=handoff.migrated,
        pool=pool,
        images=handoff.images,
    )


def encode_offer(handoff: KVHandoff, pool: KVPoolOffer) -> list[bytes]:
    """The one message of a pool offer: its header."""
    return [_encoder.encode(transfer_header(handoff, pool=pool))]


def encode_handoff(handoff: KVHandoff, *, chunk_layers: int = 1) -> Iterator[list[Frame | np.ndarray]]:
    """The messages of one transfer, in order. Each layer is read (copied out of pages, for an
    engine's export) only when its message is built, so send each message before taking the next."""
    header = transfer_header(handoff, chunk_layers=chunk_layers)
    num_layers = handoff.num_layers
    for first in range(0, num_layers, chunk_layers):
        lead = header if first == 0 else KVTransferChunk(request_id=handoff.request_id, first_layer=first)
        layers = [_layer_frame(handoff, i) for i in range(first, min(first + chunk_layers, num_layers))]
        yield [_encoder.encode(lead), *layers]


def send_handoff(socket: zmq.Socket, handoff: KVHandoff, *, chunk_layers: int = 1) -> None:
    """Send a handoff as consecutive messages on `socket` (PUSH, PAIR or DEALER: ordered, one peer)."""
    for message in encode_handoff(handoff, chunk_layers=chunk_layers):
        socket.send_multipart(message, copy=False)


@dataclass(slots=True)
class _Partial:
    header: KVTransferHeader
    dtype: torch.dtype
    layer_bytes: int
    layers: list[torch.Tensor] = field(default_factory=list)


class HandoffAssembler:
    """Rebuilds handoffs from received messages (any number of transfers interleaved by request).

    `feed` takes one message's frames (without a ROUTER's identity frame) and returns the KVHandoff
    when that message completes it, else None; it raises KVTransferError for anything malformed.
    """

    def __init__(self, *, max_partial: int = MAX_PARTIAL_TRANSFERS, kv_layout: str | None = None) -> None:
        """`kv_layout`, when given, is the receiving cache's layout: a transfer of another is refused at
        its header, before any of its KV is taken in."""
        self.max_partial = max_partial
        self.kv_layout = kv_layout
        self.partial: dict[str, _Partial] = {}

    def feed(self, frames: Sequence[Frame]) -> KVHandoff | None:
        if not frames:
            raise KVTransferError("empty message")
        return self.feed_decoded(decode_lead(frames[0]), frames)

    def feed_decoded(self, lead: KVTransferMessage, frames: Sequence[Frame]) -> KVHandoff | None:
        """`feed`, with the message's first frame already decoded (decode_lead)."""
        request_id = lead.request_id
        try:
            if isinstance(lead, KVTransferHeader):
                state, first = self._start(lead), 0
            else:
                state, first = self._continue(lead), lead.first_layer
            count = min(state.header.chunk_layers, state.header.num_layers - first)
            if len(frames) != 1 + count:
                raise KVTransferError(f"message for layers from {first} has {len(frames) - 1} frames, expected {count}")
            state.layers.extend(_tensor(frame, state, first + i) for i, frame in enumerate(frames[1:]))
        except KVTransferError as error:
            self.partial.pop(request_id, None)
            raise KVTransferError(str(error.args[0]), request_id) from None
        if len(state.layers) < state.header.num_layers:
            return None
        del self.partial[request_id]
        return handoff_of(state.header, state.layers)

    def discard(self, request_id: str) -> None:
        """Forget a partly received transfer (its sender gave up or died)."""
        self.partial.pop(request_id, None)

    def _start(self, header: KVTransferHeader) -> _Partial:
        if header.request_id in self.partial:
            raise KVTransferError("a second header arrived before the first transfer completed")
        if len(self.partial) >= self.max_partial:
            raise KVTransferError(f"{len(self.partial)} transfers are already being assembled")
        if header.pool is not None:
            raise KVTransferError("a pool offer carries no frames")
        dtype = check_header(header, self.kv_layout)
        layer_bytes = math.prod(header.layer_shape) * dtype.itemsize
        state = _Partial(header=header, dtype=dtype, layer_bytes=layer_bytes)
        self.partial[header.request_id] = state
        return state

    def _continue(self, chunk: KVTransferChunk) -> _Partial:
        state = self.partial.get(chunk.request_id)
        if state is None:
            raise KVTransferError("a chunk arrived without a header")
        if chunk.first_layer != len(state.layers):
            raise KVTransferError(f"chunk starts at layer {chunk.first_layer}; expected {len(state.layers)}")
        return state


def decode_lead(frame: Frame) -> KVTransferMessage:
    """A transfer message's first frame; KVTransferError when it is not one."""
    try:
        return _decoder.decode(frame_buffer(frame))
    except msgspec.DecodeError as error:
        raise KVTransferError(f"unreadable header frame: {error}") from None


def check_header(header: KVTransferHeader, kv_layout: str | None = None) -> torch.dtype:
    """The dtype of a header whose counts and shapes agree with each other, and whose layout is
    `kv_layout` when that is given (the receiving cache's); else KVTransferError."""
    dtype = DTYPES.get(header.dtype)
    if dtype is None:
        raise KVTransferError(f"dtype {header.dtype!r} is not one of {sorted(DTYPES)}")
    if not 0 < len(header.kv_layout) <= MAX_LAYOUT_CHARS:
        raise KVTransferError(f"its KV layout has {len(header.kv_layout)} characters, not 1 to {MAX_LAYOUT_CHARS}")
    if header.pool is not None and header.pool.kv_layout != header.kv_layout:
        raise KVTransferError(
            f"it offers a pool laid out as {header.pool.kv_layout[:MAX_LAYOUT_CHARS]!r}, its KV as {header.kv_layout!r}"
        )
    if kv_layout is not None and header.kv_layout != kv_layout:
        raise KVTransferError(f"it holds KV laid out as {header.kv_layout!r}; this worker's cache holds {kv_layout!r}")
    planes, heads, tokens, width = header.layer_shape
    num_tokens = len(header.prompt_token_ids) + len(header.output_token_ids)
    if not 0 < header.num_computed_tokens <= num_tokens:
        raise KVTransferError(f"num_computed_tokens {header.num_computed_tokens} is not in [1, {num_tokens}]")
    if planes not in (1, 2) or heads < 1 or width < 1 or tokens != header.num_computed_tokens:
        raise KVTransferError(
            f"layer shape {header.layer_shape} is not [1 or 2 planes, heads, {header.num_computed_tokens}, width]"
        )
    if header.num_layers < 1 or header.chunk_layers < 1:
        raise KVTransferError(f"num_layers {header.num_layers} and chunk_layers {header.chunk_layers} must be >= 1")
    return dtype


def handoff_of(header: KVTransferHeader, layers: Sequence[torch.Tensor] = ()) -> KVHandoff:
    """The handoff a checked header describes (check_header), with the layers that came with it."""
    planes, heads, _, width = header.layer_shape
    return KVHandoff(
        request_id=header.request_id,
        prompt_token_ids=header.prompt_token_ids,
        output_token_ids=header.output_token_ids,
        params=header.params,
        num_computed_tokens=header.num_computed_tokens,
        num_cached_tokens=header.num_cached_tokens,
        traffic_class=header.traffic_class,
        cache_namespace=header.cache_namespace,
        kv_model_id=header.kv_model_id,
        kv_dtype=DTYPES[header.dtype],
        kv_layout=header.kv_layout,
        token_shape=(planes, heads, width),
        num_layers=header.num_layers,
        layers=layers,
        migrated=header.migrated,
        images=header.images,
    )


def _layer_frame(handoff: KVHandoff, index: int) -> np.ndarray:
    layer = handoff.layers[index]
    if layer.dtype != handoff.kv_dtype or tuple(layer.shape) != handoff.layer_shape:
        raise ValueError(
            f"layer {index} is {layer.dtype} {tuple(layer.shape)}; the handoff says {handoff.kv_dtype} "
            f"{handoff.layer_shape}"
        )
    return tensor_frame(layer.to("cpu"))


def frame_buffer(frame: Frame) -> memoryview:
    """The bytes of a received (or to be sent) frame, without a copy."""
    return frame.buffer if isinstance(frame, zmq.Frame) else memoryview(frame)


def frame_tensor(buffer: memoryview, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor of `dtype` and `shape` over a frame's bytes, whose length the caller checked."""
    data = np.frombuffer(buffer, dtype=np.uint8)
    # A read-only buffer (bytes) or one the dtype cannot be read from in place is copied; zmq.Frame
    # buffers are writable and malloc-aligned, so received tensors are views of the frames.
    if not data.flags.writeable or data.ctypes.data % dtype.itemsize:
        data = data.copy()
    return torch.from_numpy(data).view(dtype).view(tuple(shape))


def tensor_frame(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor's bytes as a frame ZMQ sends zero-copy (bytes, not the dtype: numpy has no bfloat16)."""
    return tensor.contiguous().view(-1).view(torch.uint8).numpy()


def _tensor(frame: Frame, state: _Partial, index: int) -> torch.Tensor:
    buffer = frame_buffer(frame)
    if buffer.nbytes != state.layer_bytes:
        raise KVTransferError(f"layer {index} has {buffer.nbytes} bytes, expected {state.layer_bytes}")
    return frame_tensor(buffer, state.dtype, state.header.layer_shape)
