from django.apps import AppConfig


class PoliciesConfig(AppConfig):
    name = "controlplane.policies"
    label = "policies"
    verbose_name = "KV TTL policies and expert placement"

    def ready(self) -> None:
        # Registers the app's Celery tasks in every process: the services queue them by name, and
        # without a broker (eager) they run in the process that queued them.
        from controlplane.policies import tasks  # noqa: F401
