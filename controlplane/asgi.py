import os

from channels.routing import ProtocolTypeRouter
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# Sets Django up, so it comes before the imports that reach models.
django_application = get_asgi_application()

from controlplane.gateway.api_handler import ApiHandler, is_api_path  # noqa: E402
from controlplane.gateway.lifespan import lifespan  # noqa: E402
from controlplane.gateway.request_body import BodyLimitMiddleware  # noqa: E402

api_application = ApiHandler()


async def http_application(scope: dict, receive, send) -> None:
    handler = api_application if is_api_path(scope["path"]) else django_application
    await handler(scope, receive, send)


application = ProtocolTypeRouter({"http": BodyLimitMiddleware(http_application), "lifespan": lifespan})
