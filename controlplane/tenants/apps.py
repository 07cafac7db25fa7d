from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "controlplane.tenants"
    label = "tenants"
    verbose_name = "Tenants and API keys"
