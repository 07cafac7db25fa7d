"""`python manage.py run_registry --endpoint ENDPOINT`: records engine workers in the topology.

Workers started with `--registry-endpoint ENDPOINT --pool NAME` register here; their heartbeats keep
their EngineInstance rows current, and an instance silent for `--heartbeat-timeout` seconds is marked
failed (the gateway stops routing to it on its own, from the same missing heartbeats). With
SLUICE_CURVE_KEY_FILE, only workers holding the cluster's CURVE key get through on the network.
"""

import signal
import threading

from django.core.management.base import CommandError

from controlplane.common.data_plane import data_plane_key
from controlplane.common.migrated import MigratedDatabaseCommand
from controlplane.topology.registry import TopologyRecorder, topology_registry_server
from workers.curve import CurveError, check_endpoints
from workers.protocol.messages import HEARTBEAT_TIMEOUT_S

# The database needs a worker's load a few times a minute, not the ten heartbeats a second it sends.
HEARTBEAT_REPORT_INTERVAL_S = 1.0


class Command(MigratedDatabaseCommand):
    help = "Record engine workers' registrations and heartbeats in the topology until Ctrl-C."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--endpoint", required=True, help="ZMQ endpoint to bind, e.g. tcp://*:7000")
        parser.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S, help="seconds")

    def handle(self, *args, endpoint: str, heartbeat_timeout: float, **options) -> None:
        try:
            key = data_plane_key()
            check_endpoints([endpoint], key)
        except CurveError as error:
            raise CommandError(str(error)) from None
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        recorder = TopologyRecorder(heartbeat_timeout_s=heartbeat_timeout)
        server = topology_registry_server(
            endpoint, recorder, heartbeat_report_interval_s=HEARTBEAT_REPORT_INTERVAL_S, key=key
        )
        # Instances that went silent while no registry ran are found by this sweep, not by the server.
        sweeper = threading.Thread(
            target=_sweep_until, args=(recorder, stop, heartbeat_timeout), name="silence-sweep", daemon=True
        )
        sweeper.start()
        server.serve(stop)
        sweeper.join()


def _sweep_until(recorder: TopologyRecorder, stop: threading.Event, interval_s: float) -> None:
    while not stop.wait(interval_s):
        recorder.fail_silent()
