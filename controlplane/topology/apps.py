from django.apps import AppConfig


class TopologyConfig(AppConfig):
    name = "controlplane.topology"
    label = "topology"
    verbose_name = "Cluster topology"
