"""`python manage.py run_worker --role mixed --model ... --request-endpoint ... --heartbeat-endpoint ...`"""

import argparse

from django.core.management.base import BaseCommand

from workers.worker.args import WorkerArgs, add_worker_arguments
from workers.worker.process import configure_logging, run_worker_process


class Command(BaseCommand):
    help = "Run one engine worker process (ZMQ requests in, token streams out, heartbeats)."

    def add_arguments(self, parser) -> None:
        add_worker_arguments(parser)

    def handle(self, *args, **options) -> None:
        configure_logging()
        run_worker_process(WorkerArgs.from_namespace(argparse.Namespace(**options)))
