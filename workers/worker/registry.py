"""Worker registration, both sides: the worker announces itself to a registry until one acknowledges
it; the registry records workers through callbacks and watches their heartbeats.

The registry holds no storage of its own: the control plane passes callables that write where it
keeps the cluster topology (PostgreSQL), so this module needs no Django. Sockets: the registry binds
a ROUTER (registrations in, RegistrationAcks out) and connects one SUB to every registered worker's
heartbeat PUB; a worker connects a DEALER to the registry. Over the network all of them are CURVE
(workers.curve): a worker without the cluster's key never gets its registration through.
"""

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import zmq

from workers import curve
from workers.protocol.messages import HEARTBEAT_TIMEOUT_S, RegistrationAck, WorkerHeartbeat, WorkerRegistration

log = logging.getLogger(__name__)

REGISTRATION_RETRY_S = 2.0
POLL_S = 0.1


def registration_thread(
    context: zmq.Context,
    endpoint: str | None,
    registration: WorkerRegistration,
    stop: threading.Event,
    *,
    key: curve.CurveKey | None,
) -> threading.Thread | None:
    """The thread that announces a worker (of any role) at the registry `endpoint` until it is
    acknowledged or `stop` is set; None without a registry."""
    if not endpoint:
        return None
    return threading.Thread(
        target=register_until_acknowledged,
        args=(context, endpoint, registration, stop),
        kwargs={"key": key},
        name="registration",
        daemon=True,
    )


def register_until_acknowledged(
    context: zmq.Context,
    endpoint: str,
    registration: WorkerRegistration,
    stop: threading.Event,
    *,
    retry_interval_s: float = REGISTRATION_RETRY_S,
    key: curve.CurveKey | None = None,
) -> bool:
    """Send `registration` to the registry at `endpoint`, again every `retry_interval_s` until it
    answers ok or `stop` is set; returns whether it was acknowledged. Run it on its own thread: the
    registry may start long after the worker, or refuse it until an operator acts. `key`: the
    cluster's CURVE key (a registry that does not take it never hears from this worker)."""
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(RegistrationAck)
    payload = encoder.encode(registration)
    with context.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        # Queue nothing while the registry is away: otherwise every retry would wait in the queue and
        # a registry that comes up later would be flooded with copies.
        dealer.setsockopt(zmq.IMMEDIATE, 1)
        curve.connect(dealer, endpoint, key)
        next_send = 0.0
        last_refusal = None
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_send:
                try:
                    dealer.send(payload, zmq.NOBLOCK)
                    next_send = now + retry_interval_s
                except zmq.Again:  # not connected yet: try again shortly
                    next_send = now + POLL_S
            if not dealer.poll(POLL_S * 1000):
                continue
            try:
                ack = decoder.decode(dealer.recv())
            except msgspec.DecodeError as error:
                log.error("undecodable answer from the registry %s: %s", endpoint, error)
                continue
            if ack.ok:
                log.info("worker %s registered with %s", registration.worker_id, endpoint)
                return True
            if ack.message != last_refusal:
                log.warning("registry %s refused worker %s: %s", endpoint, registration.worker_id, ack.message)
                last_refusal = ack.message
    return False


@dataclass
class _Watched:
    registration: WorkerRegistration
    last_heard: float  # time.monotonic(): its last heartbeat, or its registration
    last_reported: float = float("-inf")
    last_state: str = ""
    silent: bool = False


class RegistryServer:
    """Accepts worker registrations and watches the registered workers' heartbeats.

    on_register(registration) returns None to accept, or a message saying why it is refused (the
    worker will retry). on_heartbeat(heartbeat) is called for the heartbeats of registered workers,
    at most once per `heartbeat_report_interval_s` per worker unless its state changed (0: every one).
    on_silence(worker_id) is called once when a registered worker sends no heartbeat for
    `heartbeat_timeout_s`, and again only after its heartbeats resumed and stopped again.
    Callbacks run on the serving thread; one that raises is logged and does not stop the server.
    `known` are workers registered before this server started (a restarted registry learns them from
    the control plane's records): they are watched at once, without calling on_register, because
    workers do not register again once acknowledged. on_exit runs on the serving thread as it ends
    (to release what the callbacks held there, such as a database connection). `key`: the cluster's
    CURVE key, for the ROUTER and the heartbeat subscriptions the rule of workers.curve secures; a
    registration whose heartbeats this registry could not follow without one is refused.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        on_register: Callable[[WorkerRegistration], str | None],
        on_heartbeat: Callable[[WorkerHeartbeat], object],
        on_silence: Callable[[str], object],
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        heartbeat_report_interval_s: float = 0.0,
        known: Sequence[WorkerRegistration] = (),
        on_exit: Callable[[], object] = lambda: None,
        context: zmq.Context | None = None,
        key: curve.CurveKey | None = None,
    ) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be positive, got {heartbeat_timeout_s}")
        self.endpoint = endpoint
        self.bound_endpoint = ""  # as bound, e.g. with the port chosen for "tcp://*:0"
        self._on_register = on_register
        self._on_heartbeat = on_heartbeat
        self._on_silence = on_silence
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._report_interval_s = heartbeat_report_interval_s
        self._context = context or zmq.Context.instance()
        self._key = key
        self._workers: dict[str, _Watched] = {}
        self._known = list(known)
        self._on_exit = on_exit
        self._encoder = msgspec.msgpack.Encoder()
        self._registration_decoder = msgspec.msgpack.Decoder(WorkerRegistration)
        self._heartbeat_decoder = msgspec.msgpack.Decoder(WorkerHeartbeat)
        self._bound = threading.Event()
        self._bind_error: Exception | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Serve on a daemon thread; returns once bound (raises if the endpoint cannot be bound)."""
        self._thread = threading.Thread(target=self.serve, args=(self._stop,), name="worker-registry", daemon=True)
        self._thread.start()
        self._bound.wait()
        if self._bind_error is not None:
            raise self._bind_error

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def serve(self, stop: threading.Event) -> None:
        """Serve until `stop` is set (blocking)."""
        router = self._context.socket(zmq.ROUTER)
        subscriber = self._context.socket(zmq.SUB)
        try:
            router.setsockopt(zmq.LINGER, 0)
            subscriber.setsockopt(zmq.LINGER, 0)
            subscriber.setsockopt(zmq.SUBSCRIBE, b"")
            try:
                curve.bind(router, self.endpoint, self._key)
            except (zmq.ZMQError, curve.CurveError) as error:
                self._bind_error = error
                raise
            finally:
                self._bound.set()
            self.bound_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            log.info("worker registry listening on %s", self.bound_endpoint)
            for registration in self._known:
                try:
                    self._watch(registration, subscriber)
                except curve.CurveError as error:  # left silent: the sweep fails it
                    log.error("cannot follow worker %s: %s", registration.worker_id, error)
            poller = zmq.Poller()
            poller.register(router, zmq.POLLIN)
            poller.register(subscriber, zmq.POLLIN)
            poll_ms = min(self._heartbeat_timeout_s / 4, POLL_S) * 1000
            while not stop.is_set():
                ready = dict(poller.poll(poll_ms))
                if router in ready:
                    self._receive_registrations(router, subscriber)
                if subscriber in ready:
                    self._receive_heartbeats(subscriber)
                self._check_silence(time.monotonic())
        finally:
            router.close()
            subscriber.close()
            self._on_exit()

    def _receive_registrations(self, router: zmq.Socket, subscriber: zmq.Socket) -> None:
        while True:
            try:
                peer, *frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if len(frames) != 1:
                    raise msgspec.DecodeError(f"expected one message frame, got {len(frames)}")
                registration = self._registration_decoder.decode(frames[0])
            except msgspec.DecodeError as error:
                log.warning("malformed registration from peer %s: %s", peer.hex(), error)
                router.send_multipart([peer, self._encoder.encode(RegistrationAck("", False, str(error)))])
                continue
            refusal = self._register(registration, subscriber)
            ack = RegistrationAck(registration.worker_id, refusal is None, refusal or "")
            router.send_multipart([peer, self._encoder.encode(ack)])

    def _register(self, registration: WorkerRegistration, subscriber: zmq.Socket) -> str | None:
        try:
            curve.check_endpoints([registration.heartbeat_endpoint], self._key)
        except curve.CurveError as error:
            return str(error)
        try:
            refusal = self._on_register(registration)
        except Exception as error:
            log.exception("on_register failed for worker %s", registration.worker_id)
            return f"the registry failed to record the worker: {error}"
        if refusal is not None:
            return refusal
        self._watch(registration, subscriber)
        return None

    def _watch(self, registration: WorkerRegistration, subscriber: zmq.Socket) -> None:
        previous = self._workers.get(registration.worker_id)
        endpoint = registration.heartbeat_endpoint
        if previous is None or previous.registration.heartbeat_endpoint != endpoint:
            if previous is not None and not self._watches(previous.registration.heartbeat_endpoint, previous):
                subscriber.disconnect(previous.registration.heartbeat_endpoint)
            if not self._watches(endpoint, previous):
                curve.connect(subscriber, endpoint, self._key)
        # A registration starts a new lifetime (a restart re-registers): silence is counted from it.
        self._workers[registration.worker_id] = _Watched(registration, last_heard=time.monotonic())
        log.info("watching worker %s (%s, heartbeats on %s)", registration.worker_id, registration.pool, endpoint)

    def _watches(self, endpoint: str, besides: _Watched | None) -> bool:
        """Whether a registered worker other than `besides` publishes on `endpoint`."""
        return any(w is not besides and w.registration.heartbeat_endpoint == endpoint for w in self._workers.values())

    def _receive_heartbeats(self, subscriber: zmq.Socket) -> None:
        while True:
            try:
                payload = subscriber.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                heartbeat = self._heartbeat_decoder.decode(payload)
            except msgspec.DecodeError as error:
                log.error("undecodable heartbeat: %s", error)
                continue
            watched = self._workers.get(heartbeat.worker_id)
            if watched is None:
                continue
            now = time.monotonic()
            watched.last_heard = now
            if watched.silent:
                watched.silent = False
                log.info("worker %s sends heartbeats again", heartbeat.worker_id)
            if heartbeat.state == watched.last_state and now - watched.last_reported < self._report_interval_s:
                continue
            watched.last_reported = now
            watched.last_state = heartbeat.state
            self._call(self._on_heartbeat, heartbeat)

    def _check_silence(self, now: float) -> None:
        for worker_id, watched in self._workers.items():
            if not watched.silent and now - watched.last_heard > self._heartbeat_timeout_s:
                watched.silent = True
                log.warning("worker %s sent no heartbeat for %.1f s", worker_id, now - watched.last_heard)
                self._call(self._on_silence, worker_id)

    @staticmethod
    def _call(callback: Callable[[object], object], argument: object) -> None:
        try:
            callback(argument)
        except Exception:
            log.exception("registry callback %s failed", getattr(callback, "__name__", callback))
