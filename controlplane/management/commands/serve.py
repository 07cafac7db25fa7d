"""`python manage.py serve`: the whole stack on this machine (gateway + engine workers), supervised.

Workers: one prefill and one decode worker by default (`--prefill N --decode M` for more), or
`--workers K` mixed workers (prefill and decode in one process) instead; `--encode E` adds E vision
encoders (the same model's vision tower and connector, so only for a model that takes images), which
encode a request's images and hand their embeddings to the worker computing its prompt. They are each
pool's lower bound: the autoscaler (on the supervisor's timer) and operators add workers up to a
pool's max, started by the local node agent, also on the supervisor's timer.

The KV store: every worker uses it, decode workers persisting the blocks they complete and
checkpointing their requests beside them, so a decode worker that dies has its requests resumed on
another from the store. Its GC runs as a process of its own (`run_kv_gc`, supervised like the
workers, which run none): TTL expiry and the capacity watermark over every block, and stale
checkpoints. With the in-process ("memory") index that process keeps the store's one index and
serves it on an ipc socket, which the workers and the gateway use as their index
(workers.kvstore.gc_process says why); with the Redis index everyone shares that one. Either way the
gateway reads the index to weigh each request's prefill work by its hit length.
"""

import argparse
import socket
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, OutputWrapper
from django.utils import timezone

from controlplane.common.migrated import MIGRATE, pending_migrations
from controlplane.dev_key import dev_api_key
from controlplane.policies.tasks import ep_rebalance_tick_task
from controlplane.supervisor import Child, StopStep, Supervisor, Timer, child_env, management_command
from controlplane.topology.node_agent import reconcile_local, record_exit
from controlplane.topology.selectors import local_workers_kv_capacity, local_workers_registered
from controlplane.topology.services import autoscale_tick, topology_ensure_local
from workers.args import EngineArgs, add_engine_arguments
from workers.client.routing.router import STEP_BUDGET_S
from workers.engine.weights import ModelFiles, resolve_model
from workers.kvstore.gc_options import add_gc_arguments
from workers.kvstore.gc_process import StoreGCConfig
from workers.text.vision_prompt import VISION_ARCHITECTURES
from workers.worker.args import WorkerArgs
from workers.worker.node_agent import NodeAgent

# uvicorn's handling of the gateway's connections (README, "Request limits"): each request head has a
# deadline (SLUICE_HEADER_READ_TIMEOUT_S, in the protocol class), an idle keep-alive connection is
# closed after 5 s, and at most 16 KiB of an unfinished request head is buffered (h11's default,
# spelled out).
GATEWAY_HTTP_OPTIONS = (
    "--http=controlplane.gateway.http_protocol:HeadDeadlineH11Protocol",
    "--timeout-keep-alive=5",
    "--h11-max-incomplete-event-size=16384",
)


# How often the local node agent looks for instances to start or end and reaps its workers, and how
# often the gateway looks for the workers it adds.
AGENT_ROUND_S = 1.0
WORKER_DISCOVERY_INTERVAL_S = 2.0

# The order serve's children stop in (Child.stop_stage): the gateway first (no new requests), then the
# engine workers, serve's and the node agent's (they finish their KV store writes, which need the
# store's index), then the registry and the store's GC process, which keeps that index.
STOP_GATEWAY, STOP_WORKERS, STOP_SERVICES = 0, 1, 2

ENCODE_ROLE = "encode"
# The architectures whose checkpoints carry a vision tower an encode worker runs (the engine's
# Idefics3 family, workers.engine.models.registry); read from config.json, without loading torch.


class Command(BaseCommand):
    help = "Run the gateway and engine workers on this machine until Ctrl-C."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--workers", type=int, help="run this many mixed prefill+decode workers instead")
        parser.add_argument("--prefill", type=int, help="prefill workers (default 1)")
        parser.add_argument("--decode", type=int, help="decode workers (default 1)")
        parser.add_argument(
            "--encode",
            type=int,
            default=0,
            help="vision encoder workers (default 0); they run the model's vision tower, so the model must take images",
        )
        parser.add_argument("--no-kv-store", action="store_true", help="run without the global KV store")
        # The store's GC process's settings (its runs, capacity, eviction policy).
        add_gc_arguments(parser, interval_help="seconds between runs of the store's GC (default: %(default)s)")
        # Every engine setting, passed on to the workers.
        add_engine_arguments(
            parser, defaults={"model": settings.SLUICE_MODELS[0], "kv_store": str(Path(settings.VAR_DIR) / "kvstore")}
        )

    def handle(
        self,
        *args,
        host: str,
        port: int,
        workers: int | None,
        prefill: int | None,
        decode: int | None,
        encode: int,
        no_kv_store: bool,
        kv_gc_interval: float,
        kv_store_capacity_bytes: int,
        kv_eviction_policy: str,
        **options,
    ) -> None:
        roles = _worker_roles(workers, prefill, decode)
        if encode < 0:
            raise CommandError(f"--encode must be at least 0, got {encode}")
        try:
            engine = EngineArgs.from_namespace(argparse.Namespace(**options))
        except ValueError as error:
            raise CommandError(str(error)) from None
        model, kv_store_index = engine.model, engine.kv_store_index
        if no_kv_store:
            engine = replace(engine, kv_store=None)
        engine = with_device_share(engine, len(roles) + encode)
        if engine.kv_store:
            try:  # the GC process's settings, checked here rather than in a child that would keep failing
                StoreGCConfig(
                    store=str(engine.kv_store),
                    index=kv_store_index,
                    interval_s=kv_gc_interval,
                    capacity_bytes=kv_store_capacity_bytes,
                    eviction_policy=kv_eviction_policy,
                )
            except ValueError as error:
                raise CommandError(str(error)) from None
        self._migrate()
        # A step-time model fitted on this machine (python -m bench.fit_cost_model) plans prefill steps
        # and routing; without one the gateway routes by a nominal model and steps have no time budget.
        fitted = Path(settings.VAR_DIR) / "cost_model.json"
        if engine.cost_model is None and fitted.exists():
            engine = replace(
                engine, cost_model=str(fitted), step_budget_ms=engine.step_budget_ms or STEP_BUDGET_S * 1000
            )
        # Convert the packaged weights here, once, with a visible progress bar, before children race for them.
        roles += encode_roles(encode, resolve_model(model, progress=True))
        # The private directory of the ipc sockets, removed once everything stopped, however serve ends.
        with tempfile.TemporaryDirectory(prefix="sluice-") as runtime:
            self._serve(
                Path(runtime),
                roles=roles,
                engine=engine,
                kv_store_index=kv_store_index,
                host=host,
                port=port,
                kv_gc_interval=kv_gc_interval,
                kv_store_capacity_bytes=kv_store_capacity_bytes,
                kv_eviction_policy=kv_eviction_policy,
            )

    def _serve(
        self,
        runtime: Path,
        *,
        roles: list[str],
        engine: EngineArgs,
        kv_store_index: str,
        host: str,
        port: int,
        kv_gc_interval: float,
        kv_store_capacity_bytes: int,
        kv_eviction_policy: str,
    ) -> None:
        """The children in `runtime`, the banner, and the supervisor until it stopped them all."""
        model, device = engine.model, engine.device
        if engine.kv_store and kv_store_index == "memory":
            # The store's GC process serves its index here, in the private runtime directory.
            engine = replace(engine, kv_store_index=f"ipc://{runtime}/kv-index")
        role_engines = engines_by_role(engine)
        # Workers register here; the registry keeps their EngineInstance rows current.
        registry_endpoint = f"ipc://{runtime}/registry"
        pools = [(role, role, roles.count(role)) for role in dict.fromkeys(roles)]
        hostname = socket.gethostname()
        topology_ensure_local(
            hostname=hostname,
            model=model,
            pools=pools,
            quantization=engine.quantization or "",
            kv_cache_dtype=engine.kv_cache_dtype,
        )
        names = [_worker_name(role, roles[:index].count(role)) for index, role in enumerate(roles)]
        endpoints = [(f"ipc://{runtime}/{name}.requests", f"ipc://{runtime}/{name}.heartbeats") for name in names]
        try:
            workers = [
                WorkerArgs(
                    engine=role_engines[role],
                    role=role,
                    worker_id=name,
                    request_endpoint=requests,
                    heartbeat_endpoint=heartbeats,
                    transfer_endpoint=f"ipc://{runtime}/{name}.kv" if role == "decode" else None,
                    pool=role,
                    registry_endpoint=registry_endpoint,
                    kv_gc_interval_s=0,  # one GC per store: its own process, below
                )
                for name, role, (requests, heartbeats) in zip(names, roles, endpoints)
            ]
        except ValueError as error:
            raise CommandError(str(error)) from None
        children = [
            Child(name=args.worker_id, argv=worker_command(args), env=child_env(), stop_stage=STOP_WORKERS)
            for args in workers
        ]
        if engine.kv_store:
            served = kv_store_index == "memory"
            children.append(
                Child(
                    name="kv-gc",
                    argv=management_command(
                        "run_kv_gc",
                        f"--kv-store={engine.kv_store}",
                        *(
                            ["--kv-store-index=memory", f"--serve-index={engine.kv_store_index}"]
                            if served
                            else [f"--kv-store-index={kv_store_index}"]
                        ),
                        f"--kv-gc-interval={kv_gc_interval}",
                        f"--kv-store-capacity-bytes={kv_store_capacity_bytes}",
                        f"--kv-eviction-policy={kv_eviction_policy}",
                    ),
                    env=child_env(),
                    stop_stage=STOP_SERVICES,
                )
            )
        children.append(
            Child(
                name="registry",
                argv=management_command("run_registry", f"--endpoint={registry_endpoint}"),
                env=child_env(),
                stop_stage=STOP_SERVICES,
            )
        )
        children.append(
            Child(
                name="gateway",
                argv=[
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "controlplane.asgi:application",
                    f"--host={host}",
                    f"--port={port}",
                    "--log-level=warning",
                    "--no-access-log",
                    *GATEWAY_HTTP_OPTIONS,
                ],
                env=child_env(
                    SLUICE_MODELS=model,
                    SLUICE_WORKER_ENDPOINTS=",".join(f"{r}|{h}" for r, h in endpoints),
                    # The gateway reads the store's index for hit lengths.
                    SLUICE_KV_STORE_INDEX=engine.kv_store_index if engine.kv_store else "",
                    SLUICE_COST_MODEL=str(engine.cost_model or ""),
                    # Workers the local node agent adds register later: the gateway follows them.
                    SLUICE_WORKER_DISCOVERY_INTERVAL_S=str(WORKER_DISCOVERY_INTERVAL_S),
                ),
                stop_stage=STOP_GATEWAY,
            )
        )
        # The local node's agent: the workers the autoscaler (or an operator) adds beyond these.
        agent = NodeAgent(
            runtime_dir=runtime,
            registry_endpoint=registry_endpoint,
            worker_options=lambda role: [*role_engines[role].to_argv(), "--kv-gc-interval=0"],
            on_exit=record_exit,
            env=child_env(),
            curve_key_file=settings.SLUICE_CURVE_KEY_FILE,
        )
        timers = [
            Timer("node agent", AGENT_ROUND_S, lambda: reconcile_local(agent, hostname)),
            Timer("autoscaler", settings.SLUICE_AUTOSCALE_INTERVAL_S, AutoscalerAfterStart(names)),
            Timer(
                "KV cache report",
                WORKER_DISCOVERY_INTERVAL_S,
                KVCacheReport([name for name, role in zip(names, roles) if role != ENCODE_ROLE], self.stdout),
            ),
            Timer("eplb", settings.SLUICE_EP_REBALANCE_TICK_S, ep_rebalance_tick_task.delay),
        ]
        stop_added_workers = StopStep(STOP_WORKERS, lambda: agent.stop_all(grace_s=settings.SLUICE_NODE_STOP_GRACE_S))
        supervisor = Supervisor(children, timers, stop_steps=[stop_added_workers])
        supervisor.listen_for_stop()
        key = dev_api_key()
        self.stdout.write(
            f"\nsluice is starting: {_describe(roles)} of {model} on {device}\n"
            f"  API        http://{host}:{port}/v1   (OpenAI- and Anthropic-compatible)\n"
            f"  dev key    {key}\n"
            f"  control    http://{host}:{port}/admin/ and /api/v1/docs/ "
            "(users: python manage.py createsuperuser)\n"
            f"  cost model {engine.cost_model or 'nominal (fit one: python -m bench.fit_cost_model)'}\n"
            f"  KV store   {_describe_store(engine.kv_store, kv_store_index)}\n"
            f"  try        curl http://{host}:{port}/v1/chat/completions -H 'Authorization: Bearer {key}' "
            f"-H 'content-type: application/json' "
            f'-d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hi!"}}]}}\'\n'
            "Ctrl-C stops everything.\n\n"
        )
        self.stdout.flush()
        supervisor.run()

    def _migrate(self) -> None:
        """The embedded default sets its database up itself: a fresh SQLite file under var/ or an empty
        PostgreSQL gets its tables before anything starts (`make run` has migrated already)."""
        pending = pending_migrations()
        if pending:
            self.stdout.write(f"Applying {pending} database migrations ({MIGRATE})")
            call_command("migrate", interactive=False, verbosity=0)


class AutoscalerAfterStart:
    """The autoscaler's tick, from once serve's own workers registered (until then the pools look empty
    and it would start more of them), or once a start may take no longer."""

    def __init__(self, worker_ids: list[str]) -> None:
        self.worker_ids = worker_ids
        self.started_at = timezone.now()
        self.waiting = True

    def __call__(self) -> None:
        if self.waiting:
            waited = (timezone.now() - self.started_at).total_seconds()
            registered = local_workers_registered(worker_ids=self.worker_ids, since=self.started_at)
            if not registered and waited < settings.SLUICE_INSTANCE_START_TIMEOUT_S:
                return
            self.waiting = False
        autoscale_tick()


class KVCacheReport:
    """Says once how many tokens each of serve's workers' KV cache holds, when they have all registered
    and reported it in a heartbeat (the banner is printed before they start). Each worker's log says
    how its cache was sized."""

    def __init__(self, worker_ids: list[str], stdout: OutputWrapper) -> None:
        self.worker_ids = worker_ids
        self.stdout = stdout
        self.started_at = timezone.now()
        self.reported = False

    def __call__(self) -> None:
        if self.reported:
            return
        capacities = local_workers_kv_capacity(worker_ids=self.worker_ids, since=self.started_at)
        if len(capacities) < len(self.worker_ids):
            return
        sizes = ", ".join(f"{worker_id} {capacities[worker_id]:,} tokens" for worker_id in self.worker_ids)
        self.stdout.write(f"sluice's workers are up. KV cache: {sizes}\n")
        self.stdout.flush()
        self.reported = True


def engines_by_role(engine: EngineArgs) -> dict[str, EngineArgs]:
    """The engine settings of each role's workers, from serve's. Decode workers run their steps
    unbudgeted, with no cost model unless DSpark's verification budget reads its step-time curve;
    encoders run the same model's vision tower: no steps to budget, no KV and so no KV store."""
    dspark = engine.spec_method != "none" and engine.spec_budget == "dspark"
    decode = replace(engine, cost_model=engine.cost_model if dspark else None, step_budget_ms=None)
    return {"decode": decode, "prefill": engine, "mixed": engine, ENCODE_ROLE: replace(decode, kv_store=None)}


def with_device_share(engine: EngineArgs, num_workers: int) -> EngineArgs:
    """The settings of each of `num_workers` workers started on engine.device: on a CUDA device they
    share its memory, each sizing its KV cache from gpu_memory_utilization / num_workers of it (an EP
    worker's ranks, one per device, share each of their devices with as many ranks)."""
    if engine.device.split(":")[0] != "cuda":
        return engine
    return replace(engine, gpu_memory_utilization=engine.gpu_memory_utilization / num_workers)


def _worker_roles(workers: int | None, prefill: int | None, decode: int | None) -> list[str]:
    """The role of each worker to start, prefill workers first."""
    if workers is not None:
        if prefill is not None or decode is not None:
            raise CommandError("--workers (mixed workers) excludes --prefill and --decode")
        if workers < 1:
            raise CommandError(f"--workers must be at least 1, got {workers}")
        return ["mixed"] * workers
    prefill, decode = 1 if prefill is None else prefill, 1 if decode is None else decode
    if prefill < 1 or decode < 1:
        raise CommandError(f"--prefill and --decode must be at least 1, got {prefill} and {decode}")
    return ["prefill"] * prefill + ["decode"] * decode


def encode_roles(encode: int, files: ModelFiles) -> list[str]:
    """The roles of `encode` vision encoders of the model in `files`: refused when there are some and
    the model takes no images (it has no vision tower to run)."""
    if encode and not VISION_ARCHITECTURES.intersection(files.config.get("architectures") or ()):
        architectures = ", ".join(files.config.get("architectures") or ()) or "none named"
        raise CommandError(
            f"--encode {encode}: model {files.name!r} is text-only (architecture: {architectures}), so it has "
            f"no vision tower for encode workers to run; serve a vision-language model "
            f"({', '.join(sorted(VISION_ARCHITECTURES))}) or leave out --encode"
        )
    return [ENCODE_ROLE] * encode


def worker_command(args: WorkerArgs) -> list[str]:
    """The command that starts one of serve's workers with `args`."""
    return management_command("run_worker", *args.to_argv())


def _worker_name(role: str, index: int) -> str:
    return f"worker-{index}" if role == "mixed" else f"{role}-{index}"


def _describe_store(directory: str | None, index: str) -> str:
    if not directory:
        return "off"
    kept_by = "kept and served by its GC process" if index == "memory" else index
    return f"{directory} (index: {kept_by}; GC: its own process, run_kv_gc)"


def _describe(roles: list[str]) -> str:
    return ", ".join(f"{roles.count(role)} {role}" for role in dict.fromkeys(roles)) + " worker(s)"
