"""An engine worker's configuration: the WorkerArgs struct, which validates itself, and the
command-line options that build it (shared by `python -m workers.worker` and `manage.py run_worker`).
The engine's settings are an EngineArgs (workers.args), options and all."""

import argparse

import msgspec

from workers.args import EngineArgs, add_engine_arguments
from workers.curve import KEY_FILE_VARIABLE, key_file_from_environment
from workers.kvstore.eviction import POLICIES
from workers.kvstore.gc_options import CAPACITY_BYTES, EVICTION_POLICY, GC_INTERVAL_S, add_gc_arguments

ROLES = ("mixed", "prefill", "decode")
# Longest a decode worker waits for the KV of a request it was told to expect, when the expectation
# names no timeout of its own (the gateway's name the request's predicted prefill and transfer, see
# workers.prefill_deadlines). It counts from the expectation, which comes before the prefill is even
# scheduled: a backstop for a gateway that vanished (a gateway fails a stalled transfer itself).
TRANSFER_TIMEOUT_S = 120.0


class WorkerArgs(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's own settings; its engine's are `engine` (workers.args)."""

    engine: EngineArgs
    request_endpoint: str  # bound by the ROUTER, e.g. "tcp://*:7100" or "ipc:///run/sluice/w0.req"
    heartbeat_endpoint: str  # bound by the PUB
    worker_id: str = ""  # "" = "<hostname>-<pid>"
    role: str = "mixed"
    heartbeat_interval_s: float = 0.1
    # The GC of the store, run by this worker every kv_gc_interval_s (0: another process runs it).
    kv_gc_interval_s: float = GC_INTERVAL_S
    kv_store_capacity_bytes: int = CAPACITY_BYTES
    kv_eviction_policy: str = EVICTION_POLICY
    pool: str = ""  # the pool the control plane scales this worker in
    registry_endpoint: str | None = None  # where to register (a RegistryServer); None: nowhere
    transfer_endpoint: str | None = None  # a decode worker's ROUTER for KV transfers (bound)
    transfer_timeout_s: float = TRANSFER_TIMEOUT_S
    # The host name or address peers on other hosts reach this worker at: wildcard binds
    # ("tcp://*:7100") are advertised under it. "": this host's name.
    advertise_host: str = ""
    # The cluster's CURVE key file (workers.curve): "" for none, when every endpoint is ipc:// or
    # loopback tcp://.
    curve_key_file: str = ""

    def endpoints(self) -> list[str]:
        """Every endpoint the worker binds or connects to at start."""
        return [
            self.request_endpoint,
            self.heartbeat_endpoint,
            *([self.transfer_endpoint] if self.transfer_endpoint else []),
            *([self.registry_endpoint] if self.registry_endpoint else []),
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
        if self.kv_eviction_policy not in POLICIES:
            raise ValueError(f"unknown kv_eviction_policy {self.kv_eviction_policy!r}; choose from {sorted(POLICIES)}")


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's command-line options, shared by this module's CLI and `manage.py run_worker`:
    the engine's (workers.args) and the worker's own."""
    add_engine_arguments(parser)
    parser.add_argument(
        "--role", default="mixed", choices=ROLES, help="mixed: prefill and decode in one process (default)"
    )
    parser.add_argument("--request-endpoint", required=True)
    parser.add_argument("--heartbeat-endpoint", required=True)
    parser.add_argument("--worker-id", default="")
    parser.add_argument("--heartbeat-interval", type=float, default=0.1, help="seconds")
    add_gc_arguments(
        parser, interval_help="seconds between runs of the store's GC in this worker; 0: none (run_kv_gc runs it)"
    )
    parser.add_argument("--pool", default="", help="the pool the control plane scales this worker in")
    parser.add_argument("--registry-endpoint", help="register with the control plane's registry there")
    parser.add_argument("--transfer-endpoint", help="decode workers: bind the socket KV transfers arrive on here")
    parser.add_argument(
        "--transfer-timeout",
        type=float,
        default=TRANSFER_TIMEOUT_S,
        help="seconds a decode worker waits for KV when the expectation names no timeout",
    )
    parser.add_argument(
        "--advertise-host",
        default="",
        help="the host name or address other hosts reach this worker at: wildcard binds (tcp://*:7100) are "
        "registered under it (default: this host's name)",
    )
    parser.add_argument(
        "--curve-key-file",
        default=key_file_from_environment(),
        help=f"the cluster's CURVE key file (default: ${KEY_FILE_VARIABLE}); every tcp:// socket is then "
        "authenticated and encrypted, and without it only loopback tcp:// is allowed",
    )


def config_from_arguments(args: argparse.Namespace) -> WorkerArgs:
    return WorkerArgs(
        engine=EngineArgs.from_namespace(args),
        role=args.role,
        request_endpoint=args.request_endpoint,
        heartbeat_endpoint=args.heartbeat_endpoint,
        worker_id=args.worker_id,
        heartbeat_interval_s=args.heartbeat_interval,
        kv_gc_interval_s=args.kv_gc_interval,
        kv_store_capacity_bytes=args.kv_store_capacity_bytes,
        kv_eviction_policy=args.kv_eviction_policy,
        pool=args.pool,
        registry_endpoint=args.registry_endpoint,
        transfer_endpoint=args.transfer_endpoint,
        transfer_timeout_s=args.transfer_timeout,
        advertise_host=args.advertise_host,
        curve_key_file=args.curve_key_file,
    )
