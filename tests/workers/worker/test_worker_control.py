"""Control commands to workers: drain and resume, shutdown, TTL policy, expert layout, retries of one
command; unit tests of the state machine, then real worker processes over real ZMQ."""

import asyncio
import random
import threading
import time

import msgspec
import pytest
import zmq

from tests.workers.worker_process import (
    CONFIG,
    LONG,
    Dealer,
    collect,
    connected_client,
    start_worker,
    token_ids,
    wait_for_heartbeat,
    wait_for_worker_heartbeat,
)
from workers.client.control_client import new_command_id, send_control, wait_for_state
from workers.client.worker_link import WorkerUnavailableError
from workers.engine import SamplingParams
from workers.kvstore.ttl import TTLPolicy
from workers.protocol.messages import (
    ApplyEPLayoutRequest,
    ControlAck,
    DrainRequest,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
    ResumeRequest,
    SetTTLPolicyRequest,
    ShutdownRequest,
    StatusRequest,
    WorkerHeartbeat,
)
from workers.worker.control import WorkerControl

VOCAB = CONFIG["vocab_size"]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class FakeCollector:
    def __init__(self) -> None:
        self.policies: list[TTLPolicy] = []

    def set_ttl_policy(self, policy: TTLPolicy) -> None:
        self.policies.append(policy)


def control(in_flight: list[int] | None = None, **options) -> WorkerControl:
    """A WorkerControl whose in-flight count is `in_flight[0]`."""
    count = in_flight if in_flight is not None else [0]
    ep_size = options.pop("ep_size", 1)
    options.setdefault("apply_placement", lambda num_logical_experts, placement: None)
    return WorkerControl("w", ep_size=lambda: ep_size, num_in_flight=lambda: count[0], **options)


def layout(version: int, experts: int, placement: list[list[list[int]]]) -> ApplyEPLayoutRequest:
    return ApplyEPLayoutRequest(new_command_id(), version, experts, placement)


# The state machine alone.


def test_drain_waits_for_the_requests_in_flight_and_resume_reopens():
    in_flight = [2]
    machine = control(in_flight, collector=None)

    ack = machine.handle(DrainRequest("d"))
    assert (ack.ok, ack.state, ack.num_in_flight, machine.accepting) == (True, "draining", 2, False)
    in_flight[0] = 0
    machine.check_drained()
    assert machine.handle(StatusRequest("s")).state == "drained"
    assert machine.handle(ResumeRequest("r")).state == "ready" and machine.accepting


def test_a_repeated_command_id_gets_the_first_answer_without_acting_again():
    machine = control(collector=None)

    first = machine.handle(DrainRequest("d"))
    machine.handle(ResumeRequest("r"))
    again = machine.handle(DrainRequest("d"))

    assert again == first and again.state == "drained"
    assert machine.state == "ready"


def test_the_memory_of_answers_is_bounded_and_status_is_always_fresh():
    machine = control(collector=None, remembered_answers=2)

    machine.handle(DrainRequest("old"))
    machine.handle(ResumeRequest("r1"))
    machine.handle(ResumeRequest("r2"))  # pushes "old" out
    assert machine.handle(DrainRequest("old")).state == "drained"  # acted on again
    assert machine.handle(StatusRequest("s")).state == "drained"
    machine.handle(ResumeRequest("r3"))
    assert machine.handle(StatusRequest("s")).state == "ready"


def test_a_ttl_policy_goes_to_the_collector_and_a_bad_or_stale_one_changes_nothing():
    collector = FakeCollector()
    machine = control(collector=collector)
    policy = {"ttl_s": {"chat": 60.0}, "default_class": "chat"}

    assert machine.handle(SetTTLPolicyRequest("a", 2, policy)).ttl_policy_version == 2
    stale = machine.handle(SetTTLPolicyRequest("b", 1, policy))
    negative = machine.handle(SetTTLPolicyRequest("c", 3, {"ttl_s": {"chat": -1.0}, "default_class": "chat"}))

    assert collector.policies == [TTLPolicy.from_dict(policy)]
    assert not stale.ok and "older" in stale.message
    assert not negative.ok and "positive" in negative.message
    assert machine.ttl_policy_version == 2


@pytest.mark.parametrize(
    ("ep_size", "experts", "placement", "message"),
    [
        (2, 4, [[[0, 1, 2], [3, 0, 0]], [[3, 2, 1], [0, 1, 1]]], ""),  # redundant copies of an expert are fine
        (1, 4, [[[0, 1, 2, 2]]], "layer 0: experts [3] have no slot"),
        (1, 4, [[[0, 1, 2, 3]], [[0, 1, 2, 2]]], "layer 1: experts [3] have no slot"),
        (1, 2, [[[0, 1, 2]]], "outside 0..1"),
        (1, 2, [[[0, -1, 1]]], "outside 0..1"),
        (2, 2, [[[0, 1]]], "ep_size 2"),
        (2, 2, [[[0], [1]], [[0, 1], [1, 0]]], "layer 1: every rank must hold the same number of slots"),
        (2, 2, [[[0], [1, 0]]], "layer 0: every rank must hold the same number of slots"),
        (1, 2, [], "no layers"),
        (1, 0, [[[]]], "positive"),
    ],
    ids=[
        "valid",
        "missing-expert",
        "missing-in-a-later-layer",
        "id-too-large",
        "negative-id",
        "wrong-rank-count",
        "slots-differ-between-layers",
        "slots-differ-between-ranks",
        "no-layers",
        "no-experts",
    ],
)
def test_ep_layouts_are_checked_against_the_workers_shape(ep_size, experts, placement, message):
    machine = control(collector=None, ep_size=ep_size)

    ack = machine.handle(layout(7, experts, placement))

    assert ack.ok == (not message) and message in ack.message
    assert ack.ep_layout_version == (7 if ack.ok else 0)


# Real worker processes.


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    process = start_worker(tmp_path_factory.mktemp("w"), "ctl", "--pool", "mixed-a")
    wait_for_worker_heartbeat(process.endpoints[1])
    yield process
    assert process.stop() == 0


def receive_until(dealer: Dealer, done) -> list:
    """Replies in arrival order until `done(replies)` holds."""
    replies = []
    while not done(replies):
        replies.append(dealer.receive())
    return replies


def finished(replies, request_ids) -> bool:
    ended = {r.request_id for r in replies if isinstance(r, GenerateOutput) and r.finish_reason}
    return set(request_ids) <= ended


def test_drain_finishes_what_is_in_flight_refuses_new_requests_and_resume_reopens(worker):
    request_endpoint, heartbeat_endpoint = worker.endpoints
    with Dealer(request_endpoint) as dealer:
        # One socket keeps the order: the worker admits both streams before it reads the drain.
        dealer.send(
            GenerateRequest("first", [1, 2, 3], greedy(30)),
            GenerateRequest("second", [4, 5], greedy(20)),
            DrainRequest("drain-1"),
            GenerateRequest("late", [6, 7], greedy(5)),
        )
        replies = receive_until(dealer, lambda r: finished(r, ["first", "second"]) and len(r) >= 2)
    acks = [r for r in replies if isinstance(r, ControlAck)]
    errors = [r for r in replies if isinstance(r, GenerateError)]
    outputs = [r for r in replies if isinstance(r, GenerateOutput)]

    assert [(a.ok, a.state, a.num_in_flight) for a in acks] == [(True, "draining", 2)]
    assert [(e.request_id, e.kind) for e in errors] == [("late", "draining")]
    for request_id, length in (("first", 30), ("second", 20)):
        stream = [o for o in outputs if o.request_id == request_id]
        assert len(token_ids(stream)) == length and stream[-1].finish_reason == "length"

    status = wait_for_state(request_endpoint, "drained", timeout_s=30, poll_interval_s=0.05)
    assert status.num_in_flight == 0
    assert wait_for_worker_heartbeat(heartbeat_endpoint, lambda b: b.state == "drained")

    assert send_control(request_endpoint, ResumeRequest(new_command_id())).state == "ready"
    with Dealer(request_endpoint) as dealer:
        dealer.send(GenerateRequest("after", [8, 9], greedy(3)))
        after = receive_until(dealer, lambda r: finished(r, ["after"]))
    assert len(token_ids(after)) == 3


def test_a_retried_command_is_answered_again_but_acted_on_once(worker):
    endpoint = worker.endpoints[0]

    first = send_control(endpoint, DrainRequest("drain-twice"))
    send_control(endpoint, ResumeRequest(new_command_id()))
    again = send_control(endpoint, DrainRequest("drain-twice"))

    assert first == again and first.state == "drained"
    assert send_control(endpoint, StatusRequest(new_command_id())).state == "ready"


def test_an_ep_layout_is_applied_and_reported_and_a_bad_one_refused(worker):
    request_endpoint, heartbeat_endpoint = worker.endpoints

    applied = send_control(request_endpoint, layout(3, 4, [[[3, 2, 1, 0]], [[0, 1, 2, 3]]]))
    refused = send_control(request_endpoint, layout(4, 4, [[[0, 1, 2, 2]], [[0, 1, 2, 3]]]))

    assert applied.ok and applied.ep_layout_version == 3
    assert not refused.ok and "[3]" in refused.message and refused.ep_layout_version == 3
    assert wait_for_worker_heartbeat(heartbeat_endpoint, lambda b: b.ep_layout_version == 3)


def test_a_worker_without_a_store_records_the_ttl_policy_version(worker):
    policy = TTLPolicy(ttl_s={"chat": 60.0}, default_class="chat").to_dict()

    ack = send_control(worker.endpoints[0], SetTTLPolicyRequest(new_command_id(), 5, policy))

    assert ack.ok and ack.ttl_policy_version == 5
    assert wait_for_worker_heartbeat(worker.endpoints[1], lambda b: b.ttl_policy_version == 5)


def test_heartbeats_describe_the_worker_for_the_control_plane(worker):
    request_endpoint, heartbeat_endpoint = worker.endpoints

    beat = wait_for_worker_heartbeat(heartbeat_endpoint)

    assert (beat.state, beat.pool, beat.worker_id) == ("ready", "mixed-a", "ctl")
    assert (beat.request_endpoint, beat.heartbeat_endpoint) == (request_endpoint, heartbeat_endpoint)
    assert beat.hostname
    assert (beat.weight_dtype, beat.kv_cache_dtype) == ("float32", "float32")  # the CPU's default, unquantized


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ({"type": "control.drain"}, "command_id"),
        ({"type": "control.drain", "command_id": "x", "force": True}, "force"),
        (
            {"type": "control.apply_ep_layout", "command_id": "x", "version": 1, "num_logical_experts": 2},
            "placement",
        ),
        ({"type": "control.set_ttl_policy", "command_id": "x", "version": "one", "policy": {}}, "int"),
        (
            {
                "type": "control.apply_ep_layout",
                "command_id": "x",
                "version": 1,
                "num_logical_experts": 2,
                "placement": [[0, 1]],  # [rank][slot]: a layer short
            },
            "placement[0][0]",
        ),
    ],
    ids=["no-command-id", "unknown-field", "missing-field", "wrong-type", "placement-without-layers"],
)
def test_malformed_control_frames_are_answered_and_the_worker_keeps_serving(worker, message, expected):
    with Dealer(worker.endpoints[0]) as dealer:
        dealer.socket.send(msgspec.msgpack.encode(message))
        reply = dealer.receive()
    assert isinstance(reply, GenerateError) and reply.kind == "invalid_request"
    assert expected in reply.message
    assert send_control(worker.endpoints[0], StatusRequest(new_command_id())).state == "ready"


def test_shutdown_aborts_what_is_in_flight_and_exits_zero(tmp_path):
    worker = start_worker(tmp_path, "stop")
    try:
        wait_for_worker_heartbeat(worker.endpoints[1])
        with Dealer(worker.endpoints[0]) as dealer:
            dealer.send(GenerateRequest("cut", [1, 2, 3], greedy(LONG)), ShutdownRequest("bye"))
            replies = receive_until(dealer, lambda r: any(isinstance(x, ControlAck) for x in r))
        assert worker.process.wait(timeout=30) == 0
    finally:
        worker.stop()
    outputs = [r for r in replies if isinstance(r, GenerateOutput)]
    [ack] = [r for r in replies if isinstance(r, ControlAck)]
    assert outputs[-1].finish_reason == "abort" and len(token_ids(outputs)) < LONG
    assert (ack.ok, ack.state, ack.num_in_flight) == (True, "stopping", 0)


def test_a_ttl_policy_reaches_the_stores_gc_and_a_bad_one_changes_nothing(tmp_path):
    store = tmp_path / "kvstore"
    options = ("--kv-store", str(store), "--kv-block-tokens", "64", "--kv-gc-interval", "0.2")
    worker = start_worker(tmp_path, "ttl", *options)
    request_endpoint, heartbeat_endpoint = worker.endpoints
    prompt = [random.Random(2).randrange(VOCAB) for _ in range(300)]
    try:
        with Dealer(request_endpoint) as dealer:
            dealer.send(GenerateRequest("stored", prompt, greedy(2)))
            receive_until(dealer, lambda r: finished(r, ["stored"]))
        wait_for_worker_heartbeat(heartbeat_endpoint, lambda b: b.num_store_blocks_written >= 4)
        assert len(list(store.rglob("*.blk"))) == 4

        negative = send_control(
            request_endpoint, SetTTLPolicyRequest("neg", 1, {"ttl_s": {"chat": -5.0}, "default_class": "chat"})
        )
        no_default = send_control(
            request_endpoint, SetTTLPolicyRequest("nodef", 1, {"ttl_s": {"agent": 5.0}, "default_class": "chat"})
        )
        tiny = TTLPolicy(ttl_s={"chat": 0.01}, default_class="chat").to_dict()
        applied = send_control(request_endpoint, SetTTLPolicyRequest("tiny", 1, tiny))

        deadline = time.monotonic() + 30
        while list(store.rglob("*.blk")) and time.monotonic() < deadline:
            time.sleep(0.1)
        remaining = list(store.rglob("*.blk"))
    finally:
        assert worker.stop() == 0
    assert (negative.ok, negative.ttl_policy_version) == (False, 0) and "positive" in negative.message
    assert (no_default.ok, no_default.ttl_policy_version) == (False, 0) and "default class" in no_default.message
    assert (applied.ok, applied.ttl_policy_version) == (True, 1)
    assert remaining == []


# The gateway's client and draining workers.


class LyingWorker:
    """Heartbeats say "ready", yet every request is refused as draining: the race between a drain and
    the heartbeat that reports it, made permanent."""

    def __init__(self, directory) -> None:
        self.endpoints = (f"ipc://{directory}/liar.req", f"ipc://{directory}/liar.hb")
        self.refused: list[str] = []
        self.stop = threading.Event()
        self.context = zmq.Context()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.context.term()

    def _serve(self) -> None:
        with self.context.socket(zmq.ROUTER) as router, self.context.socket(zmq.PUB) as publisher:
            router.setsockopt(zmq.LINGER, 0)
            publisher.setsockopt(zmq.LINGER, 0)
            router.bind(self.endpoints[0])
            publisher.bind(self.endpoints[1])
            beat = WorkerHeartbeat("liar", "mixed", "m", self.endpoints[0], 4096, 0, 0, 0.0, 100, 0, 0, 0, 0.0)
            while not self.stop.is_set():
                publisher.send(msgspec.msgpack.encode(beat))
                if router.poll(50):
                    peer, payload = router.recv_multipart()
                    request = msgspec.msgpack.decode(payload, type=GenerateRequest)
                    self.refused.append(request.request_id)
                    error = GenerateError(request.request_id, "draining", "liar is draining")
                    router.send_multipart([peer, msgspec.msgpack.encode(error)])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    directory = tmp_path_factory.mktemp("w")
    workers = [start_worker(directory, "a"), start_worker(directory, "b")]
    yield workers
    assert [worker.stop() for worker in workers] == [0, 0]


def test_a_drained_worker_gets_no_requests(pair):
    drained = pair[0]

    async def run():
        client = await connected_client(*(w.endpoints for w in pair))
        try:
            ack = await asyncio.to_thread(send_control, drained.endpoints[0], DrainRequest(new_command_id()))
            await wait_for_heartbeat(client, lambda b: {x.worker_id: x.state for x in b}.get("a") == "drained")
            before = {b.worker_id: b.num_prompt_tokens for b in client.healthy_workers()}
            requests = [GenerateRequest(f"r{i}", [1 + i, 2, 3], greedy(3)) for i in range(6)]
            outputs = await asyncio.gather(*(collect(client, r) for r in requests))
            after = await wait_for_heartbeat(
                client, lambda b: {x.worker_id: x.num_prompt_tokens for x in b}.get("b", 0) >= before["b"] + 18
            )
            await asyncio.to_thread(send_control, drained.endpoints[0], ResumeRequest(new_command_id()))
            return ack, before, {b.worker_id: b.num_prompt_tokens for b in after}, outputs
        finally:
            await client.close()

    ack, before, after, outputs = asyncio.run(run())
    assert ack.state == "drained"
    assert after["a"] == before["a"] and after["b"] == before["b"] + 18
    assert all(len(token_ids(stream)) == 3 for stream in outputs)


def test_a_request_refused_as_draining_is_sent_to_another_ready_worker_once(pair, tmp_path):
    liar = LyingWorker(tmp_path)
    serving = pair[1]

    async def run():
        # The liar comes first, so it wins ties for the least loaded worker.
        client = await connected_client(liar.endpoints, serving.endpoints)
        try:
            outputs = [await collect(client, GenerateRequest(f"race-{i}", [5, i + 1], greedy(2))) for i in range(3)]
        finally:
            await client.close()
        alone = await connected_client(liar.endpoints)
        try:
            with pytest.raises(WorkerUnavailableError):
                await collect(alone, GenerateRequest("nowhere", [1], greedy(2)))
        finally:
            await alone.close()
        return outputs

    try:
        outputs = asyncio.run(run())
    finally:
        liar.close()
    assert "race-0" in liar.refused and "nowhere" in liar.refused
    assert all(len(token_ids(stream)) == 2 and stream[-1].finish_reason == "length" for stream in outputs)
