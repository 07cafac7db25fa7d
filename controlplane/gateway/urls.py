from django.urls import path, re_path

from controlplane.gateway import views

urlpatterns = [
    path("v1/models", views.models, {"protocol": "models"}),
    path("v1/chat/completions", views.generate, {"protocol": "chat.completions"}),
    path("v1/completions", views.generate, {"protocol": "completions"}),
    path("v1/responses", views.generate, {"protocol": "responses"}),
    path("v1/messages", views.generate, {"protocol": "messages"}),
    path("v1/messages/count_tokens", views.count_tokens, {"protocol": "messages.count_tokens"}),
    # Last under /v1/: every other path answers 404 in its protocol's error shape.
    re_path(r"^v1/", views.unknown_path),
    path("healthz", views.healthz),
    path("metrics", views.metrics),
]
