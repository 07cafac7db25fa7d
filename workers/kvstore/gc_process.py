"""The KV store's GC as a process of its own, one per store: TTL expiry and the capacity watermark over
every block in the store, whichever process wrote or read it (`python -m workers.kvstore.gc_process`,
or `manage.py run_kv_gc`, which adds the control plane's TTL policy and reports each run to it).

Its view of the whole store:
- With the Redis index every process shares one index already: this process reads it.
- Without one (the embedded default) this process keeps the store's index itself (DirectoryIndex):
  built from the block directory at start, served on an ipc:// endpoint (`--serve-index`) that the
  workers and the gateway use as their index (`--kv-store-index ipc://...`), beside the SWA holder
  index (workers.kvstore.holders, kept here in memory), so it records every write, hit and cache
  hint, and reconciled with the directory before each run, for processes with an index of their own
  (their reads show as file mtimes, their writes as files) and for files left behind. Why not a GC
  that only lists the directory: it would know last accesses (readers touch a file's mtime) but
  neither hit counts, which the segmented LRU ranks by, nor clients' retention hints; and workers
  keeping their own indexes would go on promising blocks this process deleted. The price: a
  worker's look-up is an ipc round trip (tens of microseconds) instead of a dict look-up, and while
  this process restarts look-ups fail at once and count as misses.

Each run: reconcile (in-process index only), take the current TTL policy (`ttl_source`), expire
then evict (workers.kvstore.gc), delete checkpoint files no request can resume from and temp files
of killed writers, and report: a log line when anything was removed, and `on_report` with the
counters since the process started.

A block deleted while a worker reads it: the index entry goes first, then the file. A reader that
opened the file already reads all of it (an unlinked file lives on while it is open); one that comes
later finds no file, a clean miss, and the engine computes that part of the prompt instead.
"""

import argparse
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from workers.kvstore.block_files import BlockFiles
from workers.kvstore.checkpoint_files import remove_stale_checkpoints
from workers.kvstore.directory_index import DirectoryIndex
from workers.kvstore.eviction import POLICIES
from workers.kvstore.gc import GarbageCollector, GCReport
from workers.kvstore.gc_options import CAPACITY_BYTES, EVICTION_POLICY, GC_INTERVAL_S, add_gc_arguments
from workers.kvstore.holders import MemoryHolders
from workers.kvstore.index import BlockIndex
from workers.kvstore.index_server import IndexServer, check_ipc_endpoint
from workers.kvstore.store import open_index
from workers.kvstore.ttl import TTLPolicy
from workers.process_title import set_process_title

log = logging.getLogger(__name__)

PROCESS_TITLE = "sluice-kv-gc"


class StoreGCConfig(msgspec.Struct, frozen=True, kw_only=True):
    store: str  # the block directory
    index: str = "memory"  # "memory" (this process keeps it) or a Redis URL
    serve_index: str = ""  # ipc:// endpoint to serve the in-process index on; "": not served
    interval_s: float = GC_INTERVAL_S
    capacity_bytes: int = CAPACITY_BYTES
    eviction_policy: str = EVICTION_POLICY
    gc_id: str = ""  # "" = "kv-gc-<hostname>-<pid>"
    ttl_policy: TTLPolicy = msgspec.field(default_factory=TTLPolicy)  # until ttl_source gives one

    def __post_init__(self) -> None:
        if not self.store:
            raise ValueError("the store's directory is required")
        if self.interval_s <= 0:
            raise ValueError(f"the GC interval must be positive, got {self.interval_s}")
        if self.capacity_bytes <= 0:
            raise ValueError(f"the store capacity must be positive, got {self.capacity_bytes}")
        if self.eviction_policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {self.eviction_policy!r}; choose from {sorted(POLICIES)}")
        if self.index.startswith("ipc://"):
            raise ValueError(
                f"{self.index!r} is an index this process would serve, not one it reads: give --kv-store-index "
                "memory --serve-index ENDPOINT"
            )
        if self.serve_index:
            check_ipc_endpoint(self.serve_index)
            if self.index != "memory":
                raise ValueError("--serve-index serves the in-process index: it needs --kv-store-index memory")


class StoreGCReport(msgspec.Struct, frozen=True, kw_only=True):
    """The GC process after a run: its settings, the store's size, and its counters since it started."""

    gc_id: str
    hostname: str
    store: str
    index_kind: str  # "memory" or "redis" (a Redis URL may hold a password)
    eviction_policy: str
    capacity_bytes: int
    low_watermark: float
    high_watermark: float
    interval_s: float
    started_at: float
    reported_at: float
    num_blocks: int
    num_bytes: int
    evicted_expired: int
    evicted_capacity: int
    bytes_freed: int
    checkpoints_removed: int


TTLSource = Callable[[], TTLPolicy]
ReportSink = Callable[[StoreGCReport], object]


class StoreGC:
    """One store's GC: what a run does and what it has done (run it with `run` or `run_once`)."""

    def __init__(
        self,
        config: StoreGCConfig,
        *,
        ttl_source: TTLSource | None = None,
        on_report: ReportSink | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.gc_id = config.gc_id or f"kv-gc-{socket.gethostname()}-{os.getpid()}"
        self.files = BlockFiles(Path(config.store))
        Path(config.store).mkdir(parents=True, exist_ok=True)
        self.index: BlockIndex = DirectoryIndex() if config.index == "memory" else open_index(config.index)
        self.collector = GarbageCollector(
            self.index,
            config.ttl_policy,
            config.eviction_policy,
            capacity_bytes=config.capacity_bytes,
            delete_data=self.files.delete,
            clock=clock,
        )
        self._ttl_source = ttl_source
        self._on_report = on_report
        self._clock = clock
        self.started_at = clock()
        self.bytes_freed = 0
        self.checkpoints_removed = 0
        if isinstance(self.index, DirectoryIndex):
            self.index.reconcile(self.files)

    def run(self, stop: threading.Event) -> None:
        """A run every interval until `stop` is set; a failed run is logged and the next one comes."""
        while not stop.is_set():
            try:
                self.run_once()
            except Exception:
                log.exception("kv store gc run failed")
            stop.wait(self.config.interval_s)

    def run_once(self) -> StoreGCReport:
        if isinstance(self.index, DirectoryIndex):
            self.index.reconcile(self.files)
        self._refresh_ttl_policy()
        gc = self.collector.collect()
        checkpoints = remove_stale_checkpoints(Path(self.config.store), now=self._clock())
        self.files.recover()
        self.bytes_freed += gc.bytes_freed
        self.checkpoints_removed += checkpoints
        if gc.expired or gc.evicted or checkpoints:
            log.info("%s", _summary(gc, checkpoints, self.config.capacity_bytes))
        report = self._report(gc)
        if self._on_report is not None:
            try:
                self._on_report(report)
            except Exception:
                log.exception("reporting the kv store gc run failed")
        return report

    def _refresh_ttl_policy(self) -> None:
        if self._ttl_source is None:
            return
        try:
            self.collector.set_ttl_policy(self._ttl_source())
        except Exception:
            log.exception("reading the TTL policy failed; the GC keeps the one it has")

    def _report(self, gc: GCReport) -> StoreGCReport:
        collector = self.collector
        return StoreGCReport(
            gc_id=self.gc_id,
            hostname=socket.gethostname(),
            store=str(Path(self.config.store).resolve()),
            index_kind="memory" if self.config.index == "memory" else "redis",
            eviction_policy=self.config.eviction_policy,
            capacity_bytes=collector.capacity_bytes,
            low_watermark=collector.low_watermark,
            high_watermark=collector.high_watermark,
            interval_s=self.config.interval_s,
            started_at=self.started_at,
            reported_at=self._clock(),
            num_blocks=gc.usage_after.num_blocks,
            num_bytes=gc.usage_after.num_bytes,
            evicted_expired=collector.evicted_expired,
            evicted_capacity=collector.evicted_capacity,
            bytes_freed=self.bytes_freed,
            checkpoints_removed=self.checkpoints_removed,
        )


def _summary(gc: GCReport, checkpoints: int, capacity_bytes: int) -> str:
    expired = sum(gc.expired.values())
    by_class = ", ".join(f"{name} {count}" for name, count in sorted(gc.expired.items()))
    return (
        f"kv store gc: expired {expired}{f' ({by_class})' if by_class else ''}, evicted {gc.evicted}, "
        f"freed {_size(gc.bytes_freed)}, removed {checkpoints} stale checkpoints; the store holds "
        f"{gc.usage_after.num_blocks} blocks, {_size(gc.usage_after.num_bytes)} of {_size(capacity_bytes)}"
    )


def _size(num_bytes: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if num_bytes < 1000:
            return f"{num_bytes:.3g} {unit}"
        num_bytes /= 1000
    return f"{num_bytes:.3g} TB"


def run_store_gc_process(
    config: StoreGCConfig, *, ttl_source: TTLSource | None = None, on_report: ReportSink | None = None
) -> None:
    """The process's entry point: serves the index (when asked) on a thread and runs the GC on this
    one until SIGTERM or SIGINT."""
    set_process_title(PROCESS_TITLE)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    store_gc = StoreGC(config, ttl_source=ttl_source, on_report=on_report)
    served = ""
    server_thread = None
    context = zmq.Context()
    try:
        if config.serve_index:
            # The workers' SWA holder registrations live only as long as this process: a restart
            # forgets them, which costs replays, not wrong state.
            server = IndexServer(store_gc.index, config.serve_index, context, holders=MemoryHolders())
            server_thread = threading.Thread(target=server.serve, args=(stop,), name="kv-index-server", daemon=True)
            server_thread.start()
            served = f", served on {config.serve_index}"
        usage = store_gc.index.usage()
        log.info(
            "kv store gc %s of %s (index: %s%s): %d blocks, %s; capacity %s, policy %s, a run every %g s",
            store_gc.gc_id,
            config.store,
            "in-process" if config.index == "memory" else "redis",
            served,
            usage.num_blocks,
            _size(usage.num_bytes),
            _size(config.capacity_bytes),
            config.eviction_policy,
            config.interval_s,
        )
        store_gc.run(stop)
    finally:
        stop.set()
        if server_thread is not None:
            server_thread.join()
        context.destroy(linger=0)


def add_store_gc_arguments(parser: argparse.ArgumentParser, *, ttl_policy_option: bool) -> None:
    """The GC process's options. `ttl_policy_option`: offer --ttl-policy (without the control plane)."""
    parser.add_argument("--kv-store", required=True, help="the store's block directory")
    parser.add_argument(
        "--kv-store-index",
        default="memory",
        help='"memory": this process keeps the index, built from the directory (default); or the Redis URL '
        "of the store's shared index",
    )
    parser.add_argument(
        "--serve-index",
        default="",
        help="ipc:// endpoint to serve the in-process index on: the store's other processes then use it "
        "(--kv-store-index ENDPOINT)",
    )
    add_gc_arguments(parser, interval_help="seconds between GC runs (default: %(default)s)")
    parser.add_argument("--gc-id", default="", help="names this GC in reports (default: kv-gc-<hostname>-<pid>)")
    if ttl_policy_option:
        parser.add_argument(
            "--ttl-policy",
            type=_ttl_policy,
            default=TTLPolicy(),
            help='TTL seconds per traffic class as JSON, e.g. {"ttl_s": {"chat": 604800}, "default_class": "chat"} '
            "(default: agent 3 days, chat 7 days)",
        )


def _ttl_policy(text: str) -> TTLPolicy:
    try:
        return TTLPolicy.from_json(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"invalid TTL policy: {error}") from None


def config_from_arguments(args: argparse.Namespace) -> StoreGCConfig:
    return StoreGCConfig(
        store=args.kv_store,
        index=args.kv_store_index,
        serve_index=args.serve_index,
        interval_s=args.kv_gc_interval,
        capacity_bytes=args.kv_store_capacity_bytes,
        eviction_policy=args.kv_eviction_policy,
        gc_id=args.gc_id,
        ttl_policy=getattr(args, "ttl_policy", TTLPolicy()),
    )


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m workers.kvstore.gc_process",
        description="The KV store's GC, one process per store (manage.py run_kv_gc adds the control plane's "
        "TTL policy and reports to it).",
    )
    add_store_gc_arguments(parser, ttl_policy_option=True)
    args = parser.parse_args(argv)
    configure_logging()
    try:
        config = config_from_arguments(args)
    except ValueError as error:
        parser.error(str(error))
    run_store_gc_process(config)


if __name__ == "__main__":
    main()
