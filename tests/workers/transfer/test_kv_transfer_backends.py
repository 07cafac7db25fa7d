"""The KV transfer backends between real worker processes on the CPU: a prefill worker offers its pages
(its KV cache in shared memory) and sends frames when asked; a decode worker copies offered pages,
and refuses offers and frames that do not describe what they carry, or whose sender died mid-way.
Each refusal is a clear error for the request alone ("transfer_failed", which the gateway answers by
running the request again elsewhere), and both sides keep every page (free-page counts checked)."""

import json
import os
import re
import subprocess
import sys
import uuid
from dataclasses import replace

import msgspec
import pytest
import torch
import zmq

from tests.workers.worker_process import (
    CONFIG,
    Dealer,
    role_options,
    start_worker,
    transfer_endpoint,
    wait_for_worker_heartbeat,
)
from workers.engine import SamplingParams
from workers.engine.kv.kv_cache import KVCache
from workers.engine.kv.kv_pages import gather_tokens
from workers.engine.kv.spec import KVCacheSpecs
from workers.engine.kv_handoff import KVHandoff
from workers.engine.models.registry import model_config
from workers.protocol.messages import (
    REPLY_DONE,
    REPLY_FAILED,
    REPLY_FRAMES,
    ControlAck,
    ExpectTransferRequest,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
    HostMemoryHandle,
    KVPoolOffer,
    KVTransferHeader,
    KVTransferReply,
    StatusRequest,
)
from workers.transfer.frames import HandoffAssembler, encode_handoff, encode_offer, transfer_header
from workers.transfer.pools import PoolExport, PoolMaps

MODEL = "tiny"
PAGE = 16
TOKENS = 40  # KV of a 40-token prompt plus its first token: 3 pages
LAYERS, HEADS, HEAD_DIM = CONFIG["num_hidden_layers"], CONFIG["num_key_value_heads"], 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def start(directory, name: str, role: str, *options: str):
    return start_worker(directory, name, *role_options(directory, name, role), *options, model=MODEL)


def free_pages(worker) -> int:
    return wait_for_worker_heartbeat(worker.endpoints[1]).num_free_pages


def wait_for_free_pages(worker, count: int) -> None:
    wait_for_worker_heartbeat(worker.endpoints[1], lambda beat: beat.num_free_pages == count, timeout_s=30)


def request_handoff(request_id: str, *, heads: int = HEADS, layers: list[torch.Tensor] | None = None) -> KVHandoff:
    """A request as a prefill worker would hand it over: KV for TOKENS tokens, its first token sampled."""
    generator = torch.Generator().manual_seed(7)
    shape = (2, heads, TOKENS, HEAD_DIM)
    return KVHandoff(
        request_id=request_id,
        prompt_token_ids=[(3 * i) % CONFIG["vocab_size"] for i in range(TOKENS)],
        output_token_ids=[5],
        params=GREEDY,
        num_computed_tokens=TOKENS,
        num_cached_tokens=0,
        traffic_class="chat",
        cache_namespace="",
        kv_model_id=f"{MODEL}:float32",
        kv_dtype=torch.float32,
        kv_layout=KVCacheSpecs.of_model(tiny_config(heads), dtype=torch.float32, page_size=PAGE).layout,
        token_shape=(2, heads, HEAD_DIM),
        num_layers=LAYERS,
        layers=layers if layers is not None else [torch.randn(shape, generator=generator) for _ in range(LAYERS)],
    )


def tiny_config(heads: int = HEADS):
    return model_config({**CONFIG, "num_key_value_heads": heads})


def shared_cache(heads: int = HEADS, page_size: int = PAGE) -> KVCache:
    config = tiny_config(heads)
    cache = KVCache.for_model(
        config, num_pages=8, page_size=page_size, dtype=torch.float32, device=torch.device("cpu"), shareable=True
    )
    cache.pages.copy_(torch.randn(cache.pages.shape, generator=torch.Generator().manual_seed(1)))
    return cache


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    directory = tmp_path_factory.mktemp("decode")
    worker = start(directory, "d", "decode", "--transfer-timeout", "3")
    worker.directory = directory
    worker.idle_pages = free_pages(worker)
    yield worker
    assert worker.stop() == 0


class Forger:
    """A sending worker played by the test: a DEALER on the decode worker's transfer socket."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)

    def send(self, messages) -> None:
        for message in messages:
            self.socket.send_multipart(message, copy=False)

    def reply(self, timeout_s: float = 30.0) -> KVTransferReply:
        if not self.socket.poll(timeout_s * 1000):
            raise TimeoutError(f"no answer in {timeout_s} s")
        return msgspec.msgpack.decode(self.socket.recv(), type=KVTransferReply)

    def close(self) -> None:
        self.socket.close()
        self.context.term()


def expect(decode, request_id: str) -> Dealer:
    """A Dealer whose request the decode worker expects: its status answer comes after the expectation
    took effect (one socket, in order), so KV sent from now on is expected."""
    dealer = Dealer(decode.endpoints[0])
    dealer.send(ExpectTransferRequest(request_id), StatusRequest(f"status-{request_id}"))
    assert isinstance(dealer.receive(), ControlAck)
    return dealer


def offer(cache: KVCache, pages: list[int], **changes) -> KVPoolOffer:
    pool = PoolExport.of(cache, "forger").offer(pages, hold_s=30.0)
    return msgspec.structs.replace(pool, **changes)


def outputs_until_finished(dealer: Dealer) -> list[GenerateOutput | GenerateError]:
    outputs = [dealer.receive()]
    while isinstance(outputs[-1], GenerateOutput) and outputs[-1].finish_reason is None:
        outputs.append(dealer.receive())
    return outputs


def test_a_decode_worker_copies_offered_pages_and_decodes_what_frames_of_the_same_kv_decode(decode):
    cache = shared_cache()
    pages = [4, 2, 6]
    layers = [
        torch.stack([gather_tokens(k, torch.tensor(pages), TOKENS), gather_tokens(v, torch.tensor(pages), TOKENS)])
        for k, v in cache.layers
    ]
    streams = {}
    for request_id, messages in [
        ("by-pages", [encode_offer(request_handoff("by-pages"), offer(cache, pages))]),
        ("by-frames", list(encode_handoff(request_handoff("by-frames", layers=layers)))),
    ]:
        with expect(decode, request_id) as dealer:
            forger = Forger(transfer_endpoint(decode.directory, "d"))
            try:
                forger.send(messages)
                if request_id == "by-pages":
                    assert forger.reply() == KVTransferReply("by-pages", REPLY_DONE)
                streams[request_id] = outputs_until_finished(dealer)
            finally:
                forger.close()
    tokens = {request_id: [t for o in outputs for t in o.token_ids] for request_id, outputs in streams.items()}
    assert len(tokens["by-pages"]) == GREEDY.max_tokens - 1 and tokens["by-pages"] == tokens["by-frames"]
    wait_for_free_pages(decode, decode.idle_pages)


# Each makes an offer of one of the caches: {"two heads": the decode worker's layout, "one head"}.
REFUSALS = {
    "pages for other tokens": (lambda c: offer(c["two heads"], [1, 2]), "2 pages offered for 40 tokens"),
    "pages outside the pool": (lambda c: offer(c["two heads"], [1, 2, 99]), r"page ids outside \[0, 8\)"),
    "a handle to fewer bytes": (
        lambda c: offer(c["two heads"], [1, 2, 3], shape=(LAYERS, 2, HEADS, 64, PAGE, HEAD_DIM)),
        "the pool's memory holds .* bytes; its shape needs",
    ),
    "a pool of another layout than its header": (
        lambda c: offer(c["one head"], [1, 2, 3]),
        r"offers a pool laid out as 'full attention of layers 0-2: 1 KV heads of 16 \(float32\)', its KV as 'full "
        r"attention of layers 0-2: 2 KV heads",
    ),
    "memory that is not a KV cache": (
        lambda c: offer(c["two heads"], [1, 2, 3], handle=HostMemoryHandle(pid=os.getpid(), fd=0, num_bytes=1 << 20)),
        "is not a KV cache's memory",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_an_offer_that_does_not_describe_what_it_maps_is_refused_and_no_page_is_kept(decode, name):
    make, message = REFUSALS[name]
    refused_offer(decode, make, HEADS, message)


def test_an_offer_of_another_layout_than_the_workers_cache_is_refused_naming_both(decode):
    message = (
        r"laid out as 'full attention of layers 0-2: 1 KV heads of 16 \(float32\)'; this worker's cache holds "
        r"'full attention of layers 0-2: 2 KV heads of 16 \(float32\)'"
    )
    refused_offer(decode, lambda c: offer(c["one head"], [1, 2, 3]), 1, message)


def refused_offer(decode, make, heads: int, message: str) -> None:
    """Offer the decode worker a handoff of `heads` KV heads with `make`'s offer: refused with `message`,
    and the worker keeps no page."""
    request_id = f"refused-{uuid.uuid4().hex[:6]}"
    with expect(decode, request_id) as dealer:
        forger = Forger(transfer_endpoint(decode.directory, "d"))
        try:
            caches = {"two heads": shared_cache(), "one head": shared_cache(heads=1)}  # alive until answered
            forger.send([encode_offer(request_handoff(request_id, heads=heads), make(caches))])
            answer = forger.reply()
            error = dealer.receive()
        finally:
            forger.close()
    assert answer.action == REPLY_FAILED and answer.request_id == request_id
    assert isinstance(error, GenerateError) and error.kind == "transfer_failed"
    assert re.search(message, error.message), error.message
    wait_for_free_pages(decode, decode.idle_pages)


@pytest.mark.parametrize(
    "change, page_size, reason",
    [
        (lambda o: msgspec.structs.replace(o, host_id="another-host"), PAGE, "another host"),
        (lambda o: o, 8, "its pages hold 8 tokens, this worker's 16"),
    ],
    ids=["another host", "another page size"],
)
def test_an_offer_this_worker_cannot_map_is_answered_frames_and_the_frames_are_taken(decode, change, page_size, reason):
    request_id = f"frames-{uuid.uuid4().hex[:6]}"
    cache = shared_cache(page_size=page_size)
    pages = list(range(1, 1 + -(-TOKENS // page_size)))
    with expect(decode, request_id) as dealer:
        forger = Forger(transfer_endpoint(decode.directory, "d"))
        try:
            forger.send([encode_offer(request_handoff(request_id), change(offer(cache, pages)))])
            answer = forger.reply()
            forger.send(encode_handoff(request_handoff(request_id)))
            outputs = outputs_until_finished(dealer)
        finally:
            forger.close()
    assert answer.action == REPLY_FRAMES and reason in answer.error
    assert outputs[-1].finish_reason == "length"
    wait_for_free_pages(decode, decode.idle_pages)


@pytest.mark.parametrize(
    "messages, message",
    [
        (
            lambda h: encode_handoff(request_handoff(h.request_id, heads=1)),
            "laid out as 'full attention of layers 0-2: 1 KV heads of 16 (float32)'; this worker's cache holds 'full",
        ),
        (
            lambda h: encode_handoff(replace(h, token_shape=(2, 1, HEAD_DIM), layers=[t[:, :1] for t in h.layers])),
            "(2, 1, 16) per token, which is not its layout 'full attention of layers 0-2: 2 KV heads",
        ),
        (
            lambda h: [[msgspec.msgpack.encode(transfer_header(h, chunk_layers=LAYERS)), *[b"\x00" * 64] * LAYERS]],
            "layer 0 has 64 bytes",
        ),
    ],
    ids=["another layout", "a shape that is not its layout", "frames of another size"],
)
def test_frames_of_another_layout_or_size_than_their_header_says_are_refused(decode, messages, message):
    request_id = f"bad-frames-{uuid.uuid4().hex[:6]}"
    with expect(decode, request_id) as dealer:
        forger = Forger(transfer_endpoint(decode.directory, "d"))
        try:
            forger.send(messages(request_handoff(request_id)))
            error = dealer.receive()
        finally:
            forger.close()
    assert isinstance(error, GenerateError) and error.kind == "transfer_failed" and message in error.message
    wait_for_free_pages(decode, decode.idle_pages)


def test_a_sender_that_dies_mid_frames_fails_the_request_at_its_timeout_and_the_worker_serves_on(decode):
    request_id = "half-sent"
    with expect(decode, request_id) as dealer:
        forger = Forger(transfer_endpoint(decode.directory, "d"))
        forger.send(list(encode_handoff(request_handoff(request_id)))[:1])  # layer 0 of 3, then gone
        forger.close()
        error = dealer.receive()
    assert isinstance(error, GenerateError) and error.kind == "transfer_failed"
    assert "no KV arrived within 3 s" in error.message
    wait_for_free_pages(decode, decode.idle_pages)
    with expect(decode, "after") as dealer:
        forger = Forger(transfer_endpoint(decode.directory, "d"))
        forger.send(encode_handoff(request_handoff("after")))
        assert outputs_until_finished(dealer)[-1].finish_reason == "length"
        forger.close()


DEAD_EXPORTER = """
import sys, torch
from workers.engine.models.registry import model_config
from workers.engine.kv.kv_cache import KVCache
from workers.transfer.pools import PoolExport
import json
config = model_config(json.loads(sys.argv[1]))
cpu = torch.device("cpu")
cache = KVCache.for_model(config, num_pages=8, page_size=16, dtype=torch.float32, device=cpu, shareable=True)
handle = PoolExport.of(cache, "dead").handle
print(handle.pid, handle.fd, handle.num_bytes)
"""


def test_an_offer_from_a_sender_that_died_is_refused_and_no_page_is_kept(decode):
    exported = subprocess.run(
        [sys.executable, "-c", DEAD_EXPORTER, json.dumps(CONFIG)], capture_output=True, text=True, check=True
    )
    pid, fd, num_bytes = map(int, exported.stdout.split())
    dead = offer(
        shared_cache(), [1, 2, 3], handle=HostMemoryHandle(pid=pid, fd=fd, num_bytes=num_bytes), pool_id="dead/1"
    )
    with expect(decode, "orphan") as dealer:
        forger = Forger(transfer_endpoint(decode.directory, "d"))
        try:
            forger.send([encode_offer(request_handoff("orphan"), dead)])
            answer = forger.reply()
            error = dealer.receive()
        finally:
            forger.close()
    assert answer.action == REPLY_FAILED and "mapping pool dead/1 failed" in answer.error
    assert isinstance(error, GenerateError) and error.kind == "transfer_failed"
    wait_for_free_pages(decode, decode.idle_pages)


def test_a_prefill_worker_offers_its_pages_sends_frames_when_asked_and_frees_them_once_answered(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prefill")
    prefill = start(directory, "p", "prefill")
    endpoint = f"ipc://{directory}/fake-decode.kv"
    context = zmq.Context()
    fake_decode = context.socket(zmq.ROUTER)
    fake_decode.setsockopt(zmq.LINGER, 0)
    fake_decode.bind(endpoint)
    prompt = [(5 * i + 1) % CONFIG["vocab_size"] for i in range(TOKENS)]
    try:
        idle = free_pages(prefill)
        with Dealer(prefill.endpoints[0]) as dealer:
            results = {}
            for request_id, answer in [("asks-frames", REPLY_FRAMES), ("refuses", REPLY_FAILED)]:
                dealer.send(GenerateRequest(request_id, prompt, GREEDY, decode_endpoint=endpoint))
                first = dealer.receive()
                assert isinstance(first, GenerateOutput) and first.finish_reason == "transfer"
                assert fake_decode.poll(30_000)
                sender, lead = fake_decode.recv_multipart()
                header = msgspec.msgpack.decode(lead, type=KVTransferHeader)
                assert isinstance(header.pool.handle, HostMemoryHandle) and len(header.pool.pages) == 3
                pool = PoolMaps().open(header.pool, header.kv_layout)
                index = torch.tensor(header.pool.pages)
                offered = [
                    torch.stack([gather_tokens(pool[i, 0], index, TOKENS), gather_tokens(pool[i, 1], index, TOKENS)])
                    for i in range(LAYERS)
                ]
                fake_decode.send_multipart(
                    [sender, msgspec.msgpack.encode(KVTransferReply(request_id, answer, "test"))]
                )
                if answer == REPLY_FRAMES:
                    assembler, handoff = HandoffAssembler(), None
                    while handoff is None:
                        assert fake_decode.poll(30_000)
                        handoff = assembler.feed(fake_decode.recv_multipart()[1:])
                    results[request_id] = (offered, handoff.layers)
                # Refused: the decode worker tells the request's owner; the prefill worker frees the pages.
                wait_for_free_pages(prefill, idle)
    finally:
        fake_decode.close()
        context.term()
        assert prefill.stop() == 0
    offered, framed = results["asks-frames"]
    assert all(torch.equal(a, b) for a, b in zip(offered, framed, strict=True))
