"""The worker process's entry point: sets its title, dies with its parent, loads the cluster's CURVE
key (a bad key file, or a network endpoint without one, ends it at once with one line), builds the
engine and the store's GC (or, for role "encode", the vision encoder: workers.worker.encoder), serves
until told to stop, and reports a crash (exit code 1)."""

import argparse
import ctypes
import logging
import os
import signal
import sys
import threading

import zmq

from workers import curve
from workers.engine.factory import build_engine
from workers.kvstore.eviction import get_policy
from workers.kvstore.gc import GarbageCollector
from workers.kvstore.store import KVStore
from workers.kvstore.ttl import TTLPolicy
from workers.process_title import set_process_title
from workers.worker.args import WorkerArgs, add_worker_arguments
from workers.worker.encoder.server import run_encoder
from workers.worker.server import CLOSE_LINGER_MS, Worker

log = logging.getLogger(__name__)

PROCESS_TITLE = "sluice-worker"  # /proc/self/comm keeps 15 bytes
ENCODER_PROCESS_TITLE = "sluice-encoder"
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def run_worker_process(config: WorkerArgs) -> None:
    """The worker's entry point: returns after SIGTERM/SIGINT or a ShutdownRequest; a crash is logged
    and exits 1."""
    set_process_title(ENCODER_PROCESS_TITLE if config.role == "encode" else PROCESS_TITLE)
    _die_with_parent()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    key = _curve_key(config)
    try:
        if config.role == "encode":
            run_encoder(config, stop, key)
        else:
            _serve_engine(config, stop, key)
    except Exception:
        log.exception("worker %s crashed", config.worker_id or os.getpid())
        raise SystemExit(1) from None


def _serve_engine(config: WorkerArgs, stop: threading.Event, key: curve.CurveKey | None) -> None:
    engine = build_engine(config.engine)
    store = engine.kv_store
    collector = _start_store_gc(store, config, stop) if store is not None and config.kv_gc_interval_s else None
    context = zmq.Context()
    try:
        Worker(config, engine, context, stop, collector, key=key).serve()
    finally:
        context.destroy(linger=CLOSE_LINGER_MS)
        engine.close()


def _curve_key(config: WorkerArgs) -> curve.CurveKey | None:
    """The key the worker's sockets use, checked against its endpoints before the model loads."""
    try:
        key = curve.load_key_file(config.curve_key_file) if config.curve_key_file else None
        curve.check_endpoints(config.endpoints(), key)
    except curve.CurveError as error:
        raise SystemExit(f"worker {config.worker_id or os.getpid()}: {error}") from None
    if key is not None:
        log.info("data plane: CURVE key version %d from %s", key.version, config.curve_key_file)
    return key


def _start_store_gc(store: KVStore, config: WorkerArgs, stop: threading.Event) -> GarbageCollector:
    collector = GarbageCollector(
        store.index,
        TTLPolicy(),
        get_policy(config.kv_eviction_policy),
        capacity_bytes=config.kv_store_capacity_bytes,
        delete_data=store.files.delete,
    )
    thread = threading.Thread(
        target=collector.run_forever, args=(stop, config.kv_gc_interval_s), name="kvstore-gc", daemon=True
    )
    thread.start()
    return collector


def _die_with_parent() -> None:
    """Ask Linux to send SIGTERM when the parent exits, so a dead supervisor leaves no orphans."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    elif os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m workers.worker",
        description="An engine worker process: serves GenerateRequests over ZMQ and publishes heartbeats "
        "(role encode: a vision encoder, serving EncodeRequests).",
    )
    add_worker_arguments(parser)
    configure_logging()
    run_worker_process(WorkerArgs.from_namespace(parser.parse_args(argv)))
