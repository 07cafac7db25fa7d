from django.urls import path

from dashboard.consumers import TelemetryConsumer

websocket_urlpatterns = [path("ws/telemetry/", TelemetryConsumer.as_asgi())]
