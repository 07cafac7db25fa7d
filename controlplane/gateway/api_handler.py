"""The ASGI handler for the API paths: Django without the browser middleware.

Sessions, CSRF, authentication-by-session, messages, clickjacking and common middleware serve the
admin and the dashboard. Under ASGI each of them runs its synchronous hooks through a thread hop,
about ten per request, which cost the API ~10 ms of latency per call on a busy 2-core machine
while doing nothing for it: API callers authenticate with keys, send no cookies and no forms.
"""

from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response

# /metrics is here for speed like the rest: Prometheus scrapes it without cookies or sessions.
API_PATH_PREFIXES = ("/v1/", "/healthz", "/metrics")


class ApiHandler(ASGIHandler):
    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        self._middleware_chain = convert_exception_to_response(self._get_response_async)


def is_api_path(path: str) -> bool:
    return path.startswith(API_PATH_PREFIXES)
