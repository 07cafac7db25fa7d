"""`python -m workers.worker --ep-size 2`: two rank processes that look like one worker. One request
endpoint serves greedy streams with one process's tokens; heartbeats carry ep_size and the expert
load of real traffic; an EP layout is applied (or refused, changing nothing) over ZMQ; the worker
drains as one; when a rank dies, the worker re-forms on the survivor, serves on, and says so in its
heartbeats."""

import threading

import msgspec
import psutil
import pytest
import zmq

from tests.workers.engine.expert_parallel.tiny_moe import QWEN3_MOE
from tests.workers.worker_process import (
    KV_CACHE_BYTES,
    SEED,
    Dealer,
    start_worker,
    token_ids,
    wait_for_worker_heartbeat,
)
from workers.client.control_client import new_command_id, send_control
from workers.engine import LLM, SamplingParams
from workers.protocol.messages import (
    ApplyEPLayoutRequest,
    DrainRequest,
    GenerateOutput,
    GenerateRequest,
    RegistrationAck,
    ResumeRequest,
    WorkerRegistration,
)

PROMPTS = [[3, 14, 15, 92, 65], list(range(40, 80)), [7] * 9]
SHORT = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
MOVED = [[[7, 6, 5, 4, 3], [2, 1, 0, 7, 6]]] * 2


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A stand-in for the control plane's registry: a ROUTER that hears registrations."""
    endpoint = f"ipc://{tmp_path_factory.mktemp('registry')}/registry"
    with zmq.Context() as context, context.socket(zmq.ROUTER) as router:
        router.setsockopt(zmq.LINGER, 0)
        router.bind(endpoint)
        yield endpoint, router


@pytest.fixture(scope="module")
def ep_worker(tmp_path_factory, registry):
    options = ("--ep-size", "2", "--ep-slots-per-rank", "5", "--registry-endpoint", registry[0])
    worker = start_worker(tmp_path_factory.mktemp("ep"), "ep", *options, config=QWEN3_MOE)
    yield worker
    assert worker.stop() == 0


def test_the_ranks_register_once_as_one_worker(ep_worker, registry):
    _, router = registry
    assert router.poll(60_000), "no registration"
    peer, payload = router.recv_multipart()
    registration = msgspec.msgpack.decode(payload, type=WorkerRegistration)
    assert (registration.worker_id, registration.ep_size, registration.role) == ("ep", 2, "mixed")
    router.send_multipart([peer, msgspec.msgpack.encode(RegistrationAck("ep", ok=True))])
    # Acknowledged, the worker sends no more; and its ranks never register on their own.
    assert not router.poll(1000)


def _outputs(dealer: Dealer, request_ids: set[str]) -> dict[str, list[GenerateOutput]]:
    outputs: dict[str, list[GenerateOutput]] = {request_id: [] for request_id in request_ids}
    open_ids = set(request_ids)
    while open_ids:
        reply = dealer.receive(timeout_s=60)
        assert isinstance(reply, GenerateOutput), reply
        outputs[reply.request_id].append(reply)
        if reply.finish_reason is not None:
            open_ids.discard(reply.request_id)
    return outputs


def test_an_ep_worker_serves_reports_load_and_takes_layouts_as_one(ep_worker):
    request_endpoint, heartbeat_endpoint = ep_worker.endpoints
    beat = wait_for_worker_heartbeat(heartbeat_endpoint)
    assert beat.ep_size == 2 and beat.worker_id == "ep"

    expected = LLM(QWEN3_MOE, seed=SEED, kv_cache_bytes=KV_CACHE_BYTES).generate(PROMPTS, SHORT)
    with Dealer(request_endpoint) as dealer:
        dealer.send(*(GenerateRequest(f"r{i}", prompt, SHORT) for i, prompt in enumerate(PROMPTS)))
        outputs = _outputs(dealer, {f"r{i}" for i in range(len(PROMPTS))})
    assert [token_ids(outputs[f"r{i}"]) for i in range(len(PROMPTS))] == [r.token_ids for r in expected]

    # A long stream: heartbeats meanwhile carry the load of its tokens, per MoE layer and slot.
    loaded = []
    listener = threading.Thread(
        target=lambda: loaded.append(
            wait_for_worker_heartbeat(heartbeat_endpoint, lambda b: sum(map(sum, b.expert_load)) > 0)
        )
    )
    listener.start()
    with Dealer(request_endpoint) as dealer:
        dealer.send(GenerateRequest("long", PROMPTS[0], LONG))
        bad = send_control(request_endpoint, ApplyEPLayoutRequest(new_command_id(), 2, 8, [MOVED[0]]))
        good = send_control(request_endpoint, ApplyEPLayoutRequest(new_command_id(), 3, 8, MOVED))
        long_outputs = _outputs(dealer, {"long"})["long"]
    listener.join()
    assert not bad.ok and "2 layers" in bad.message and bad.ep_layout_version == 0
    assert good.ok and good.ep_layout_version == 3
    assert len(token_ids(long_outputs)) == 300
    [beat] = loaded
    assert len(beat.expert_load) == 2 and all(len(layer) == 10 for layer in beat.expert_load)
    assert wait_for_worker_heartbeat(heartbeat_endpoint, lambda b: b.ep_layout_version == 3).ep_size == 2

    # The new placement serves with the same tokens; then the worker drains as one.
    with Dealer(request_endpoint) as dealer:
        dealer.send(GenerateRequest("after", PROMPTS[1], SHORT))
        assert token_ids(_outputs(dealer, {"after"})["after"]) == expected[1].token_ids
    assert send_control(request_endpoint, DrainRequest(new_command_id())).state == "drained"


def test_a_rank_that_dies_is_reported_and_the_worker_serves_on(ep_worker):
    """After the test above: the worker is drained, with its two ranks."""
    request_endpoint, heartbeat_endpoint = ep_worker.endpoints
    assert send_control(request_endpoint, ResumeRequest(new_command_id())).state == "ready"
    descendants = psutil.Process(ep_worker.process.pid).children(recursive=True)
    [rank] = [process for process in descendants if process.name() == "sluice-ep-rank"]
    rank.kill()

    expected = LLM(QWEN3_MOE, seed=SEED, kv_cache_bytes=KV_CACHE_BYTES).generate(PROMPTS[:1], SHORT)
    with Dealer(request_endpoint) as dealer:
        dealer.send(GenerateRequest("survivor", PROMPTS[0], SHORT))
        assert token_ids(_outputs(dealer, {"survivor"})["survivor"]) == expected[0].token_ids
    # Layout 3 was for two ranks: it is not in force any more.
    beat = wait_for_worker_heartbeat(heartbeat_endpoint, lambda b: b.ep_size == 1 and b.ep_layout_version == 0)
    assert "re-formed with 1 ranks" in beat.ep_resize_reason and beat.ep_resized_at > 0
    # Layouts are checked against the group as it is now: one rank, holding all 8 experts.
    one_rank = [[[7, 6, 5, 4, 3, 2, 1, 0]]] * 2
    assert send_control(request_endpoint, ApplyEPLayoutRequest(new_command_id(), 4, 8, one_rank)).ok
    assert not send_control(request_endpoint, ApplyEPLayoutRequest(new_command_id(), 5, 8, MOVED)).ok
