"""WorkerArgs: every setting of an engine worker once — name, type, default, validation, help and
command-line flag — beside its engine's, which are an EngineArgs (workers.args), options and all.

`python -m workers.worker` and `manage.py run_worker` parse a WorkerArgs from their command line
(`add_worker_arguments`, `WorkerArgs.from_namespace`); `serve` and the node agent write one back as
that command line (`to_argv()`) for each worker they start. Torch-free, so the control plane can
build worker command lines without loading the engine.
"""

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from workers.args import EngineArgs, add_engine_arguments, add_setting_arguments, setting, setting_argv
from workers.curve import KEY_FILE_VARIABLE, key_file_from_environment
from workers.kvstore.eviction import POLICIES
from workers.kvstore.gc_options import (
    CAPACITY_BYTES,
    CAPACITY_HELP,
    EVICTION_POLICY,
    EVICTION_POLICY_HELP,
    GC_INTERVAL_S,
)

# "encode": a vision encoder (workers.worker.encoder), which runs a vision-language model's vision tower
# only and sends images' embeddings to the worker computing their prompt.
ROLES = ("mixed", "prefill", "decode", "encode")
HEARTBEAT_INTERVAL_S = 0.1
# Longest a decode worker waits for the KV of a request it was told to expect, when the expectation
# names no timeout of its own (the gateway's name the request's predicted prefill and transfer, see
# workers.client.prefill_deadlines). It counts from the expectation, which comes before the prefill is even
# scheduled: a backstop for a gateway that vanished (a gateway fails a stalled transfer itself). The
# same bound holds a request with images waiting for their embeddings from an encode worker
# (workers.worker.image_inbox): the gateway retries a failed encoder itself, within it.
TRANSFER_TIMEOUT_S = 120.0
# An encode worker's embedding cache: about 250 SmolVLM-2B images of 17 tiles (64 × 2048 bf16 per tile).
EMBEDDING_CACHE_BYTES = 1 << 30
# An encode worker's largest vision-tower batch: 16 tiles of SmolVLM's 32 × 32 patches.
MAX_ENCODE_PATCHES = 16384


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerArgs:
    """A worker's own settings and its engine's (`engine`); validated on construction (ValueError)."""

    engine: EngineArgs
    request_endpoint: str = setting(help='bind the ROUTER requests arrive on here, e.g. "tcp://*:7100"')
    heartbeat_endpoint: str = setting(help="bind the PUB heartbeats go out on here")
    worker_id: str = setting("", help="the worker's name", none="<hostname>-<pid>")
    role: str = setting("mixed", choices=ROLES, help="mixed: prefill and decode in one process")
    heartbeat_interval_s: float = setting(HEARTBEAT_INTERVAL_S, flag="--heartbeat-interval", help="seconds")
    # The GC of the store, run by this worker every kv_gc_interval_s (0: another process runs it).
    kv_gc_interval_s: float = setting(
        GC_INTERVAL_S,
        flag="--kv-gc-interval",
        help="seconds between runs of the store's GC in this worker; 0: none (run_kv_gc runs it)",
    )
    kv_store_capacity_bytes: int = setting(CAPACITY_BYTES, help=CAPACITY_HELP)
    kv_eviction_policy: str = setting(EVICTION_POLICY, choices=sorted(POLICIES), help=EVICTION_POLICY_HELP)
    pool: str = setting("", help="the pool the control plane scales this worker in")
    registry_endpoint: str | None = setting(None, help="register with the control plane's registry there")
    transfer_endpoint: str | None = setting(None, help="decode workers: bind the socket KV transfers arrive on here")
    transfer_timeout_s: float = setting(
        TRANSFER_TIMEOUT_S,
        flag="--transfer-timeout",
        help="seconds a decode worker waits for KV when the expectation names no timeout, and a request waits "
        "for its images' embeddings",
    )
    swa_state_endpoint: str | None = setting(
        None,
        help="sliding-window models: bind the socket other workers fetch SWA state from here",
        none="beside the request endpoint (ipc: its path + '.swa'; tcp: the same host, a port the system picks)",
    )
    embedding_cache_bytes: int = setting(
        EMBEDDING_CACHE_BYTES,
        help="encode workers: bytes of image embeddings kept by content hash, least recently used evicted (0: none)",
    )
    max_encode_patches: int = setting(
        MAX_ENCODE_PATCHES,
        help="encode workers: vision-tower patches per batch, in whole tiles (one tile at least)",
    )
    advertise_host: str = setting(
        "",
        help="the host name or address other hosts reach this worker at: wildcard binds (tcp://*:7100) are "
        "registered under it",
        none="this host's name",
    )
    curve_key_file: str = setting(
        "",
        help="the cluster's CURVE key file; every tcp:// socket is then authenticated and encrypted, and "
        "without it only loopback tcp:// is allowed",
        none=f"${KEY_FILE_VARIABLE}",
    )

    def endpoints(self) -> list[str]:
        """Every endpoint the worker binds or connects to at start."""
        return [
            self.request_endpoint,
            self.heartbeat_endpoint,
            *([self.transfer_endpoint] if self.transfer_endpoint else []),
            *([self.registry_endpoint] if self.registry_endpoint else []),
            *([self.swa_state_endpoint] if self.swa_state_endpoint else []),
        ]

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if (self.role == "decode") != bool(self.transfer_endpoint):
            raise ValueError("a decode worker needs a transfer_endpoint, and only a decode worker has one")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be positive, got {self.transfer_timeout_s}")
        if self.engine.ep_size > 1 and self.role != "mixed":
            raise ValueError(f"an expert-parallel worker (ep_size {self.engine.ep_size}) serves role mixed only")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be positive, got {self.heartbeat_interval_s}")
        if self.kv_gc_interval_s < 0:
            raise ValueError(f"kv_gc_interval_s must be >= 0, got {self.kv_gc_interval_s}")
        if self.embedding_cache_bytes < 0:
            raise ValueError(f"embedding_cache_bytes must be >= 0, got {self.embedding_cache_bytes}")
        if self.max_encode_patches < 1:
            raise ValueError(f"max_encode_patches must be positive, got {self.max_encode_patches}")
        if self.role != "encode" and (
            self.embedding_cache_bytes != EMBEDDING_CACHE_BYTES or self.max_encode_patches != MAX_ENCODE_PATCHES
        ):
            raise ValueError("embedding_cache_bytes and max_encode_patches are settings of encode workers only")
        if self.role == "encode" and (self.swa_state_endpoint or self.engine.kv_store):
            raise ValueError(
                "an encode worker runs the vision tower only: it has no KV store and no SWA state endpoint"
            )
        if self.kv_eviction_policy not in POLICIES:
            raise ValueError(f"unknown kv_eviction_policy {self.kv_eviction_policy!r}; choose from {sorted(POLICIES)}")

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> "WorkerArgs":
        """The settings parsed by a parser that add_worker_arguments set up."""
        own = {f.name: getattr(namespace, f.name) for f in fields(cls) if f.name != "engine"}
        return cls(engine=EngineArgs.from_namespace(namespace), **own)

    @classmethod
    def from_argv(cls, argv: Sequence[str], **given: Any) -> "WorkerArgs":
        """The settings of a worker started with the options `argv` followed by options giving `given`
        (settings of the worker or of its engine, by name; no flags): the last given wins, as on a
        command line. Bad options raise ValueError. The CURVE key file is not taken from this process's
        environment: a worker started without one reads its own."""
        engine_names = {f.name for f in fields(EngineArgs)}
        parser = _RaisingParser(add_help=False)
        add_worker_arguments(
            parser,
            engine_defaults={name: value for name, value in given.items() if name in engine_names},
            defaults={
                "curve_key_file": "",
                **{name: value for name, value in given.items() if name not in engine_names},
            },
        )
        namespace = parser.parse_args(list(argv))
        for name, value in given.items():
            setattr(namespace, name, value)
        return cls.from_namespace(namespace)

    def to_argv(self) -> list[str]:
        """The command-line options that give these settings (those left at their default are left out)."""
        return [*self.engine.to_argv(), *setting_argv(self)]


def add_worker_arguments(
    parser: argparse.ArgumentParser,
    *,
    engine_defaults: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """The worker's command-line options, shared by `python -m workers.worker` and `manage.py
    run_worker`: the engine's (workers.args) and the worker's own. `engine_defaults` and `defaults`
    replace some defaults of the engine's settings and of the worker's; the CURVE key file defaults
    to the environment's."""
    add_engine_arguments(parser, defaults=engine_defaults)
    add_setting_arguments(parser, WorkerArgs, {"curve_key_file": key_file_from_environment(), **(defaults or {})})


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        raise ValueError(message)
