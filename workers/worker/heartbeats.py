"""What a worker tells the rest of the system about itself: its registration (who and where it is)
and its heartbeats (load, KV usage, store and GC counters, drain state), published on their own
thread every heartbeat interval."""

import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import msgspec
import torch
import zmq

from workers.engine.engine_core import EngineCore
from workers.engine.kv.swa_stats import SwaStats
from workers.engine.spec.stats import SpecDecodeStats
from workers.engine.step_stats import Buckets
from workers.kvstore.gc import GarbageCollector
from workers.kvstore.index import IndexUsage
from workers.protocol.messages import (
    HistogramCounts,
    SpecDecodeTotals,
    SwaLayers,
    SwaTotals,
    WorkerHeartbeat,
    WorkerRegistration,
)
from workers.worker.args import WorkerArgs
from workers.worker.control import WorkerControl
from workers.worker.transfers import Transfers

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    worker_id: str
    hostname: str
    started_at: float
    request_endpoint: str  # as a peer connects to it
    heartbeat_endpoint: str
    transfer_endpoint: str  # "" unless a decode worker


class HeartbeatThread(ABC):
    """Publishes a worker's heartbeats from a thread of its own, every heartbeat interval until `stop`
    is set: one engine step (a long prefill on a CPU) can take seconds, longer than a client waits
    before it declares the worker dead. The PUB socket is used by that thread alone (ZMQ sockets are
    not thread-safe)."""

    def __init__(self, interval_s: float, publisher: zmq.Socket, stop: threading.Event) -> None:
        self.interval_s = interval_s
        self.publisher = publisher
        self.stop = stop
        self.encoder = msgspec.msgpack.Encoder()
        self.thread = threading.Thread(target=self._run, name="heartbeats", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self) -> None:
        self.thread.join()

    def _run(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.publish()

    def publish(self) -> None:
        self.publisher.send(self.encoder.encode(self.heartbeat()))

    @abstractmethod
    def heartbeat(self) -> WorkerHeartbeat:
        """The worker's heartbeat now."""


class Heartbeats(HeartbeatThread):
    """An engine worker's heartbeats."""

    def __init__(
        self,
        identity: WorkerIdentity,
        config: WorkerArgs,
        engine: EngineCore,
        control: WorkerControl,
        collector: GarbageCollector | None,
        publisher: zmq.Socket,
        stop: threading.Event,
        *,
        transfers: Transfers | None = None,
        swa_layers: SwaLayers | None = None,
    ) -> None:
        """`transfers`: the worker's KV transfers, whose migration and handoff counters the heartbeats carry;
        `swa_layers`: a sliding-window model's, as every heartbeat says."""
        super().__init__(config.heartbeat_interval_s, publisher, stop)
        self.identity = identity
        self.swa_layers = swa_layers
        self.transfers = transfers
        self.config = config
        self.engine = engine
        self.control = control
        self.collector = collector
        self.store_usage = IndexUsage(num_blocks=0, num_bytes=0)  # the last read, kept when a read fails
        self.store_usage_failing = False

    def heartbeat(self) -> WorkerHeartbeat:
        # Read while the main thread steps: a racy snapshot of counters, good enough for load reports.
        stats = self.engine.stats()
        store = stats.store
        store_usage = self._read_store_usage()
        collector = self.collector
        identity = self.identity
        engine = self.engine
        info = engine.info
        group = engine.ep_group()
        transfers = self.transfers
        handoffs = transfers.handoff_totals() if transfers else None
        resume = stats.resume
        steps = stats.steps
        return WorkerHeartbeat(
            worker_id=identity.worker_id,
            role=self.config.role,
            model=info.model_name,
            request_endpoint=identity.request_endpoint,
            max_model_len=info.max_model_len,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_usage=stats.kv_usage,
            num_free_pages=stats.num_free_pages,
            num_prompt_tokens=stats.num_prompt_tokens,
            num_cached_prompt_tokens=stats.num_cached_prompt_tokens,
            num_preemptions=stats.num_preemptions,
            sent_at=time.time(),
            started_at=identity.started_at,
            num_store_hit_tokens=store.num_hit_tokens if store else 0,
            num_store_blocks_read=store.num_blocks_read if store else 0,
            num_store_blocks_written=store.num_blocks_written if store else 0,
            state=self.control.state,
            pool=self.config.pool,
            ttl_policy_version=self.control.ttl_policy_version,
            ep_layout_version=self.control.ep_layout_version,
            heartbeat_endpoint=identity.heartbeat_endpoint,
            hostname=identity.hostname,
            transfer_endpoint=identity.transfer_endpoint,
            kv_capacity_tokens=stats.num_pages * info.page_size,
            cost_model_error_p50=stats.cost_model_error[0],
            cost_model_error_p90=stats.cost_model_error[1],
            max_num_seqs=self.config.engine.max_num_seqs,
            kv_model_id=info.kv_model_id,
            kv_block_tokens=info.kv_block_tokens,
            image_token_id=getattr(info.model_config, "image_token_id", None),
            kv_store_bytes=store_usage.num_bytes,
            kv_store_blocks=store_usage.num_blocks,
            kv_store_capacity_bytes=collector.capacity_bytes if collector else 0,
            kv_store_low_watermark=collector.low_watermark if collector else 0.0,
            kv_store_high_watermark=collector.high_watermark if collector else 0.0,
            kv_store_evicted_expired=collector.evicted_expired if collector else 0,
            kv_store_evicted_capacity=collector.evicted_capacity if collector else 0,
            ep_size=group.size,
            # Taken here, so each heartbeat carries the window since the previous one.
            expert_load=engine.take_expert_load(),
            ep_resized_at=group.resized_at,
            ep_resize_reason=group.resize_reason,
            num_migrated_out=transfers.num_migrated_out if transfers else 0,
            num_migrations_failed=transfers.num_migrations_failed if transfers else 0,
            num_migrations_declined=transfers.num_migrations_declined if transfers else 0,
            num_migrated_in=transfers.num_migrated_in if transfers else 0,
            num_resumed=resume.num_resumed if resume else 0,
            num_recomputed_tokens=resume.num_recomputed_tokens if resume else 0,
            max_recomputed_tokens=resume.max_recomputed_tokens if resume else 0,
            resume_seconds_total=resume.seconds_total if resume else 0.0,
            step_seconds=histogram_counts(steps.seconds) if steps else None,
            step_tokens=histogram_counts(steps.tokens) if steps else None,
            handoff_sent=handoffs.sent if handoffs else {},
            handoff_received=handoffs.received if handoffs else {},
            num_store_fetches=store.num_fetches if store else 0,
            store_fetch_bytes=store.fetch_bytes if store else 0,
            store_fetch_seconds=store.fetch_seconds if store else 0.0,
            swa=swa_totals(stats.swa) if stats.swa else None,
            spec_decode=spec_decode_totals(stats.spec_decode) if stats.spec_decode else None,
            swa_layers=self.swa_layers,
            weight_dtype=info.weight_dtype,
            kv_cache_dtype=info.kv_cache_dtype,
        )

    def _read_store_usage(self) -> IndexUsage:
        """The store index's totals; a shared index (Redis, or the one the store's GC process serves)
        that fails to answer must not stop the heartbeats, which would make the worker look dead, so
        the last totals read stand in. Said once until it answers again, not ten times a second."""
        if self.engine.kv_store is None:
            return self.store_usage
        try:
            self.store_usage = self.engine.kv_store.index.usage()
        except Exception:
            if not self.store_usage_failing:
                log.warning("reading the KV store index's usage failed", exc_info=True)
            self.store_usage_failing = True
        else:
            self.store_usage_failing = False
        return self.store_usage


def swa_totals(stats: SwaStats) -> SwaTotals:
    return SwaTotals(**asdict(stats))


def spec_decode_totals(stats: SpecDecodeStats) -> SpecDecodeTotals:
    return SpecDecodeTotals(
        method=stats.method,
        num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        accepted_per_position=tuple(stats.accepted_per_position),
        budget=histogram_counts(stats.budget),
        calibration_error=stats.calibration_error,
    )


def histogram_counts(buckets: Buckets) -> HistogramCounts:
    return HistogramCounts(bounds=buckets.bounds, counts=tuple(buckets.counts), total=buckets.total)


def registration(identity: WorkerIdentity, config: WorkerArgs, engine: EngineCore) -> WorkerRegistration:
    """One registration for the worker, however many EP ranks (one device each) it runs."""
    device = torch.device(config.engine.device)
    on_cuda = device.type == "cuda"
    return WorkerRegistration(
        worker_id=identity.worker_id,
        pool=config.pool,
        role=config.role,
        model=engine.info.model_name,
        hostname=identity.hostname,
        request_endpoint=identity.request_endpoint,
        heartbeat_endpoint=identity.heartbeat_endpoint,
        transfer_endpoint=identity.transfer_endpoint,
        ep_size=config.engine.ep_size,
        num_accelerators=config.engine.ep_size if on_cuda else 0,
        accelerator_kind=torch.cuda.get_device_name(device) if on_cuda else device.type,
        started_at=identity.started_at,
    )
