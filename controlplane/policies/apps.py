from django.apps import AppConfig


class PoliciesConfig(AppConfig):
    name = "controlplane.policies"
    label = "policies"
    verbose_name = "KV TTL policies and expert placement"
