"""`python manage.py serve`: the whole stack on this machine (gateway + engine workers), supervised."""

import tempfile
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand

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

    def handle(self, *args, host: str, port: int, model: str, workers: int, device: str, **options) -> None:
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
            f"  try        curl http://{host}:{port}/v1/chat/completions -H 'Authorization: Bearer {key}' "
            f"-H 'content-type: application/json' "
            f'-d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hi!"}}]}}\'\n'
            "Ctrl-C stops everything.\n\n"
        )
        self.stdout.flush()
        Supervisor(children).run()
