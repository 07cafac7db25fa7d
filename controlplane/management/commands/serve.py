"""`python manage.py serve`: the whole stack on this machine (gateway + engine workers), supervised."""

import tempfile
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from controlplane.dev_key import dev_api_key
from controlplane.supervisor import Child, Supervisor, child_env, manage_py
from workers.engine.weights import resolve_model


class Command(BaseCommand):
    help = "Run the gateway and engine workers on this machine until Ctrl-C."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--model", default=settings.SLUICE_MODELS[0])
        parser.add_argument("--workers", type=int, default=1, help="mixed prefill+decode workers")
        parser.add_argument("--device", default="cpu")
        parser.add_argument(
            "--kv-store",
            default=str(Path(settings.VAR_DIR) / "kvstore"),
            help="directory of the global KV block store (default: var/kvstore)",
        )
        parser.add_argument("--kv-store-index", default="memory", help='"memory" or redis://host:port/db')
        parser.add_argument("--no-kv-store", action="store_true", help="run without the global KV store")

    def handle(
        self,
        *args,
        host: str,
        port: int,
        model: str,
        workers: int,
        device: str,
        kv_store: str,
        kv_store_index: str,
        no_kv_store: bool,
        **options,
    ) -> None:
        if not no_kv_store and kv_store_index == "memory" and workers > 1:
            raise CommandError(
                f"{workers} workers share one KV store only through the Redis index: "
                "pass --kv-store-index redis://127.0.0.1:6379/0 (or --no-kv-store)"
            )
        store_arguments = [] if no_kv_store else [f"--kv-store={kv_store}", f"--kv-store-index={kv_store_index}"]
        # Convert the packaged weights here, once, with a visible progress bar, before children race for them.
        resolve_model(model, progress=True)
        runtime = Path(tempfile.mkdtemp(prefix="sluice-"))
        endpoints = [
            (f"ipc://{runtime}/worker-{index}.requests", f"ipc://{runtime}/worker-{index}.heartbeats")
            for index in range(workers)
        ]
        children = [
            Child(
                name=f"worker-{index}",
                argv=manage_py(
                    "run_worker",
                    "--role=mixed",
                    f"--model={model}",
                    f"--device={device}",
                    f"--worker-id=worker-{index}",
                    f"--request-endpoint={requests}",
                    f"--heartbeat-endpoint={heartbeats}",
                    *store_arguments,
                    # One GC per store: the first worker runs it.
                    *([] if index == 0 else ["--kv-gc-interval=0"]),
                ),
                env=child_env(),
            )
            for index, (requests, heartbeats) in enumerate(endpoints)
        ]
        children.append(
            Child(
                name="gateway",
                argv=[
                    *manage_py()[:1],
                    "-m",
                    "uvicorn",
                    "controlplane.asgi:application",
                    f"--host={host}",
                    f"--port={port}",
                    "--log-level=warning",
                    "--no-access-log",
                ],
                env=child_env(
                    SLUICE_MODELS=model,
                    SLUICE_WORKER_ENDPOINTS=",".join(f"{r}|{h}" for r, h in endpoints),
                ),
            )
        )
        key = dev_api_key()
        self.stdout.write(
            f"\nsluice is starting: {len(endpoints)} worker(s) of {model} on {device}\n"
            f"  API        http://{host}:{port}/v1   (OpenAI- and Anthropic-compatible)\n"
            f"  dev key    {key}\n"
            f"  KV store   {'off' if no_kv_store else f'{kv_store} (index: {kv_store_index})'}\n"
            f"  try        curl http://{host}:{port}/v1/chat/completions -H 'Authorization: Bearer {key}' "
            f"-H 'content-type: application/json' "
            f'-d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hi!"}}]}}\'\n'
            "Ctrl-C stops everything.\n\n"
        )
        self.stdout.flush()
        Supervisor(children).run()
