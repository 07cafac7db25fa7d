"""The control plane's synchronous control client against stand-in workers on real ZMQ sockets."""

import threading
from collections.abc import Callable

import msgspec
import pytest
import zmq

from workers.client.control_client import (
    ControlRejectedError,
    ControlTimeoutError,
    new_command_id,
    send_control,
    wait_for_state,
)
from workers.protocol.messages import (
    ControlAck,
    DrainRequest,
    GenerateError,
    StatusRequest,
    WorkerInbound,
    WorkerOutbound,
)

Answer = Callable[[int, WorkerInbound], WorkerOutbound | None]  # (nth message, message) → reply or silence


class StandIn:
    """A ROUTER that records what it receives and replies as `answer` says."""

    def __init__(self, endpoint: str, answer: Answer) -> None:
        self.endpoint = endpoint
        self.answer = answer
        self.received: list[WorkerInbound] = []
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(endpoint)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(20):
                continue
            peer, payload = self.router.recv_multipart()
            message = msgspec.msgpack.decode(payload, type=WorkerInbound)
            self.received.append(message)
            reply = self.answer(len(self.received), message)
            if reply is not None:
                self.router.send_multipart([peer, msgspec.msgpack.encode(reply)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.router.close()
        self.context.term()


@pytest.fixture
def stand_in(tmp_path):
    started: list[StandIn] = []

    def start(answer: Answer) -> StandIn:
        started.append(StandIn(f"ipc://{tmp_path}/worker.req", answer))
        return started[-1]

    yield start
    for worker in started:
        worker.close()


def ack(message: WorkerInbound, state: str = "ready") -> ControlAck:
    return ControlAck(message.command_id, "w", True, state)


def test_an_endpoint_nobody_serves_times_out_after_the_retries(tmp_path):
    with pytest.raises(ControlTimeoutError, match="after 3 tries"):
        send_control(f"ipc://{tmp_path}/nobody.req", DrainRequest(new_command_id()), timeout_s=0.2, retries=3)


def test_a_timed_out_command_is_sent_again_with_the_same_id(stand_in):
    worker = stand_in(lambda n, message: ack(message, "drained") if n == 2 else None)
    request = DrainRequest(new_command_id())

    answer = send_control(worker.endpoint, request, timeout_s=0.5, retries=3)

    assert answer == ack(request, "drained")
    assert worker.received == [request, request]


def test_a_late_answer_to_another_command_is_not_taken_for_this_ones(stand_in):
    stale = ControlAck("another", "w", True, "ready")
    worker = stand_in(lambda n, message: stale if n == 1 else ack(message, "draining"))

    answer = send_control(worker.endpoint, DrainRequest("mine"), timeout_s=0.5, retries=2)

    assert answer.command_id == "mine" and answer.state == "draining"


def test_a_command_the_worker_cannot_read_is_rejected(stand_in):
    worker = stand_in(lambda n, message: GenerateError("", "invalid_request", "unknown tag"))

    with pytest.raises(ControlRejectedError) as rejected:
        send_control(worker.endpoint, DrainRequest(new_command_id()))

    assert rejected.value.kind == "invalid_request" and "unknown tag" in rejected.value.message


def test_wait_for_state_polls_status_until_the_state_is_reached(stand_in):
    worker = stand_in(lambda n, message: ack(message, "drained" if n >= 3 else "draining"))

    answer = wait_for_state(worker.endpoint, "drained", timeout_s=30, poll_interval_s=0.01)

    assert answer.state == "drained"
    assert all(isinstance(m, StatusRequest) for m in worker.received)
    assert len({m.command_id for m in worker.received}) == 3


def test_wait_for_state_gives_up_at_its_timeout(stand_in):
    worker = stand_in(lambda n, message: ack(message, "draining"))

    with pytest.raises(ControlTimeoutError, match="still 'draining'"):
        wait_for_state(worker.endpoint, "drained", timeout_s=0.3, poll_interval_s=0.05)
