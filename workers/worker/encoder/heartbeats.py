"""What an encode worker tells the rest of the system about itself: its registration (role "encode")
and its heartbeats (requests and patches in flight, patches encoded, the embedding cache's lookups
and bytes, the measured patches per second), published on their own thread every heartbeat
interval, so a long vision-tower batch never makes the encoder look dead."""

import threading
import time
from dataclasses import dataclass

import torch
import zmq

from workers.protocol.messages import WorkerHeartbeat, WorkerRegistration
from workers.worker.args import WorkerArgs
from workers.worker.control import WorkerControl
from workers.worker.encoder.embedding_cache import EmbeddingCache
from workers.worker.encoder.vision import VisionModel
from workers.worker.heartbeats import HeartbeatThread, WorkerIdentity


@dataclass
class EncoderLoad:
    """Written by the serving thread, read by the heartbeat thread (a racy snapshot is good enough
    for a load report)."""

    num_in_flight: int = 0  # requests held
    patches_in_flight: int = 0  # their vision-tower patches, cached images' included
    num_patches_encoded: int = 0  # since start, through the vision tower
    patches_per_second: float = 0.0  # measured at start (EncodeServer.measure_throughput)


class EncoderHeartbeats(HeartbeatThread):
    """An encode worker's heartbeats."""

    def __init__(
        self,
        identity: WorkerIdentity,
        config: WorkerArgs,
        model: VisionModel,
        control: WorkerControl,
        load: EncoderLoad,
        cache: EmbeddingCache,
        publisher: zmq.Socket,
        stop: threading.Event,
    ) -> None:
        super().__init__(config.heartbeat_interval_s, publisher, stop)
        self.identity = identity
        self.config = config
        self.model = model
        self.control = control
        self.load = load
        self.cache = cache

    def heartbeat(self) -> WorkerHeartbeat:
        identity, load, cache = self.identity, self.load, self.cache
        return WorkerHeartbeat(
            worker_id=identity.worker_id,
            role="encode",
            model=self.model.name,
            request_endpoint=identity.request_endpoint,
            max_model_len=0,
            num_running=load.num_in_flight,
            num_waiting=0,
            kv_usage=0.0,
            num_free_pages=0,
            num_prompt_tokens=0,
            num_cached_prompt_tokens=0,
            num_preemptions=0,
            sent_at=time.time(),
            started_at=identity.started_at,
            state=self.control.state,
            pool=self.config.pool,
            ttl_policy_version=self.control.ttl_policy_version,
            heartbeat_endpoint=identity.heartbeat_endpoint,
            hostname=identity.hostname,
            weight_dtype=str(self.model.dtype).removeprefix("torch."),
            patches_in_flight=load.patches_in_flight,
            num_patches_encoded=load.num_patches_encoded,
            embedding_cache_hits=cache.hits,
            embedding_cache_misses=cache.misses,
            embedding_cache_bytes=cache.num_bytes,
            patches_per_second=load.patches_per_second,
        )


def encoder_registration(identity: WorkerIdentity, config: WorkerArgs, model: VisionModel) -> WorkerRegistration:
    device = model.device
    on_cuda = device.type == "cuda"
    return WorkerRegistration(
        worker_id=identity.worker_id,
        pool=config.pool,
        role="encode",
        model=model.name,
        hostname=identity.hostname,
        request_endpoint=identity.request_endpoint,
        heartbeat_endpoint=identity.heartbeat_endpoint,
        num_accelerators=1 if on_cuda else 0,
        accelerator_kind=torch.cuda.get_device_name(device) if on_cuda else device.type,
        started_at=identity.started_at,
    )
