from django.apps import AppConfig


class TopologyConfig(AppConfig):
    name = "controlplane.topology"
    label = "topology"
    verbose_name = "Cluster topology"

    def ready(self) -> None:
        # Registers the app's Celery tasks in every process: the services queue them by name, and
        # without a broker (eager) they run in the process that queued them.
        from controlplane.topology import tasks  # noqa: F401
