import os

from channels.routing import ProtocolTypeRouter
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
# Sets Django up, so it comes before the imports that reach models.
django_application = get_asgi_application()

from controlplane.gateway.lifespan import lifespan  # noqa: E402
from controlplane.gateway.request_body import BodyLimitMiddleware  # noqa: E402

application = ProtocolTypeRouter({"http": BodyLimitMiddleware(django_application), "lifespan": lifespan})
