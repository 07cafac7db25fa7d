from django.urls import path

from controlplane.gateway import views

urlpatterns = [
    path("v1/models", views.models, {"protocol": "models"}),
    path("v1/chat/completions", views.generate, {"protocol": "chat.completions"}),
    path("v1/completions", views.generate, {"protocol": "completions"}),
    path("v1/responses", views.generate, {"protocol": "responses"}),
    path("v1/messages", views.generate, {"protocol": "messages"}),
    path("v1/messages/count_tokens", views.count_tokens, {"protocol": "messages.count_tokens"}),
    path("healthz", views.healthz),
    path("metrics", views.metrics),
]
