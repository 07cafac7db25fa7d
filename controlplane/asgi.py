import os

from channels.auth import AuthMiddlewareStack
from channels.routing import ProtocolTypeRouter, URLRouter
from channels.security.websocket import AllowedHostsOriginValidator
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# Sets Django up, so it comes before the imports that reach models.
django_application = get_asgi_application()

from controlplane.gateway.api_handler import ApiHandler, is_api_path  # noqa: E402
from controlplane.gateway.lifespan import lifespan  # noqa: E402
from controlplane.gateway.request_body import BodyLimitMiddleware  # noqa: E402
from dashboard.routing import websocket_urlpatterns  # noqa: E402

api_application = ApiHandler()


async def http_application(scope: dict, receive, send) -> None:
    handler = api_application if is_api_path(scope["path"]) else django_application
    await handler(scope, receive, send)


# Websockets sign in with the session cookie, which a browser also sends from other sites' pages:
# only pages served from our own allowed hosts may open one.
websocket_application = AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))

application = ProtocolTypeRouter(
    {"http": BodyLimitMiddleware(http_application), "websocket": websocket_application, "lifespan": lifespan}
)
