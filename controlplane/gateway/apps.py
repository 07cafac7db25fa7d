from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "controlplane.gateway"
    label = "gateway"
    verbose_name = "OpenAI/Anthropic API gateway"
