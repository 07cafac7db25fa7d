"""Django settings. Embedded default: SQLite under var/; set DATABASE_URL for PostgreSQL."""

import dataclasses
import os
import socket
from collections.abc import Mapping
from pathlib import Path

import msgspec
from django.core.exceptions import ImproperlyConfigured

from controlplane.common import task_names
from controlplane.database_url import parse_database_url
from recipe.limits import RequestLimits
from workers.curve import key_file_from_environment
from workers.protocol.messages import GrammarLimits

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("SLUICE_VAR_DIR", BASE_DIR / "var"))

DEBUG = os.environ.get("SLUICE_DEBUG", "0") == "1"
# The embedded default runs on localhost only; a deployment must set its own key.
SECRET_KEY = os.environ.get("SLUICE_SECRET_KEY", "sluice-embedded-default-not-for-deployment")
ALLOWED_HOSTS = os.environ.get("SLUICE_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver").split(",")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "channels",
    # Dash apps embedded in Django pages; its models record the apps it serves.
    "django_plotly_dash.apps.DjangoPlotlyDashConfig",
    # The operator dashboard (dashboard/), with the login page's template.
    "dashboard",
    # Project-wide management commands (serve).
    "controlplane",
]

# Our apps with models (by label, each at controlplane/<label>) keep their migrations in the
# top-level migrations/ package.
SLUICE_APPS: list[str] = ["tenants", "topology", "policies", "telemetry"]
# access (roles as groups) has no models; it comes after the apps whose permissions it assigns.
INSTALLED_APPS += [f"controlplane.{app}" for app in SLUICE_APPS] + ["controlplane.access", "controlplane.gateway"]
MIGRATION_MODULES = {app: f"migrations.{app}" for app in SLUICE_APPS}

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

# An empty DATABASE_URL counts as unset.
if not os.environ.get("DATABASE_URL"):
    VAR_DIR.mkdir(parents=True, exist_ok=True)
DATABASES = {"default": parse_database_url(os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'sluice.sqlite3'}")}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"
# Dash's scripts (components, plotly.js) are found in their Python packages at request time; the
# gateway serves them itself (controlplane/urls.py), so no collectstatic step is needed.
STATICFILES_FINDERS = [
    "django.contrib.staticfiles.finders.FileSystemFinder",
    "django.contrib.staticfiles.finders.AppDirectoriesFinder",
    "django_plotly_dash.finders.DashAssetFinder",
    "django_plotly_dash.finders.DashComponentFinder",
    "django_plotly_dash.finders.DashAppDirectoryFinder",
]

# The dashboard (dashboard/): operators sign in with Django's login page.
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/dashboard/"
LOGOUT_REDIRECT_URL = "/accounts/login/"
# django-plotly-dash puts each Dash app in an iframe of the page that embeds it.
X_FRAME_OPTIONS = "SAMEORIGIN"
PLOTLY_DASH = {
    # Scripts come from this server, never a CDN: operators' browsers may have no internet access.
    "serve_locally": True,
    # Its layout, callback and script endpoints answer only the roles that may view the dashboard.
    "view_decorator": "dashboard.access.dash_view_decorator",
}

# The control-plane API under /api/v1/ (controlplane.api).
REST_FRAMEWORK = {
    # The first class answers anonymous requests with `WWW-Authenticate: Bearer`, which makes them 401s, not 403s.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "controlplane.api.authentication.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
        "rest_framework.authentication.BasicAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["controlplane.api.permissions.RolePermission"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    # \u-escaped output: an error message that quotes a client's lone surrogate still encodes.
    "UNICODE_JSON": False,
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    # No OPTIONS introspection (OPTIONS answers 405): the schema describes every endpoint.
    "DEFAULT_METADATA_CLASS": None,
    "DEFAULT_PAGINATION_CLASS": "controlplane.api.pagination.LimitOffsetPagination",
    "DEFAULT_FILTER_BACKENDS": [
        "django_filters.rest_framework.DjangoFilterBackend",
        "controlplane.api.filters.StableOrderingFilter",
    ],
    "EXCEPTION_HANDLER": "controlplane.api.errors.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "controlplane.api.schema.AutoSchema",
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "sluice control plane",
    "DESCRIPTION": "Pools, engine instances, scaling events, KV TTL policies, EP layouts, tenants and their keys.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SCHEMA_PATH_PREFIX": "/api/v1",
    # Separate request and response components, so read-only fields are never asked for.
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {"ErrorTypeEnum": "controlplane.api.errors.ERROR_TYPES"},
}

# The embedded default has no Redis: an in-process channel layer serves one process.
CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# Celery: control messages to workers (drain, TTL and EP layout pushes). Without a broker the embedded
# default runs each task in-process when it is queued (after the transaction that queued it commits).
CELERY_TASK_ALWAYS_EAGER = not os.environ.get("SLUICE_CELERY_BROKER_URL")
# Eager tasks never reach a broker; the in-memory one only keeps kombu from looking for a default one.
CELERY_BROKER_URL = os.environ.get("SLUICE_CELERY_BROKER_URL") or "memory://localhost/"
CELERY_TASK_ACKS_LATE = True  # a worker that dies mid-task leaves it queued for another
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# How often the EPLB tick looks for MoE pools whose rebalancing interval has passed: the `serve`
# supervisor's timer in the embedded default, Celery beat with a broker.
SLUICE_EP_REBALANCE_TICK_S = float(os.environ.get("SLUICE_EP_REBALANCE_TICK_S", 30))
# How long a drain may take before the task gives up and records control_failed.
SLUICE_DRAIN_TIMEOUT_S = float(os.environ.get("SLUICE_DRAIN_TIMEOUT_S", 600))

# Node agents (README, "Elastic pools"): `celery -A controlplane worker -Q node.<SLUICE_NODE_NAME>
# --pool=solo` on every host starts and stops its workers. An instance still starting after
# SLUICE_INSTANCE_START_TIMEOUT_S fails (no agent took the start, or the worker never registered),
# and an unconsumed start task expires then.
SLUICE_NODE_NAME = os.environ.get("SLUICE_NODE_NAME") or socket.gethostname()
SLUICE_INSTANCE_START_TIMEOUT_S = float(os.environ.get("SLUICE_INSTANCE_START_TIMEOUT_S", 120))
# Where the agent's workers bind their ipc:// sockets, where they register, and the flags this host
# gives them (device, KV cache size, KV store...: `python -m workers.worker --help`).
SLUICE_NODE_RUNTIME_DIR = os.environ.get("SLUICE_NODE_RUNTIME_DIR", str(VAR_DIR / "node"))
SLUICE_REGISTRY_ENDPOINT = os.environ.get("SLUICE_REGISTRY_ENDPOINT", f"ipc://{VAR_DIR / 'registry'}")
SLUICE_NODE_WORKER_OPTIONS = os.environ.get("SLUICE_NODE_WORKER_OPTIONS", "")
# The name or address other hosts reach this node by: set, the agent's workers listen on tcp ports
# and register under it (reachable across hosts, CURVE with SLUICE_CURVE_KEY_FILE); empty, ipc sockets
# in SLUICE_NODE_RUNTIME_DIR (this host only).
SLUICE_NODE_ADVERTISE_HOST = os.environ.get("SLUICE_NODE_ADVERTISE_HOST", "")
# Seconds a stopped worker gets to exit after its shutdown request, then again after SIGTERM.
SLUICE_NODE_STOP_GRACE_S = float(os.environ.get("SLUICE_NODE_STOP_GRACE_S", 10))
# The cluster's CURVE key file (README, "Data-plane keys"; workers.curve), read by the processes that
# speak ZMQ (gateways, the registry, control tasks, node agents, which pass it on to their workers),
# when they start. Empty: no key, so only ipc:// and loopback tcp:// endpoints are allowed.
SLUICE_CURVE_KEY_FILE = key_file_from_environment()
# The autoscaler's tick (Celery beat with a broker, serve's supervisor without), and the minutes of
# telemetry it reads the prefill demand from.
SLUICE_AUTOSCALE_INTERVAL_S = float(os.environ.get("SLUICE_AUTOSCALE_INTERVAL_S", 15))
SLUICE_AUTOSCALE_LOOKBACK_MINUTES = int(os.environ.get("SLUICE_AUTOSCALE_LOOKBACK_MINUTES", 5))
# Celery beat's periodic tasks, with a broker (serve's supervisor times them without one).
CELERY_BEAT_SCHEDULE = {
    "autoscale-tick": {"task": task_names.AUTOSCALE_TICK, "schedule": SLUICE_AUTOSCALE_INTERVAL_S},
    "ep-rebalance-tick": {"task": task_names.EP_REBALANCE_TICK, "schedule": SLUICE_EP_REBALANCE_TICK_S},
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["stderr"], "level": os.environ.get("SLUICE_LOG_LEVEL", "WARNING")},
    # Django logs every 4xx as a warning; for an API gateway those are the clients' business.
    "loggers": {"django.request": {"level": "ERROR"}},
}


def _worker_endpoints(value: str) -> list[tuple[str, str]]:
    """Parses "req|hb,req|hb" into [(request_endpoint, heartbeat_endpoint), ...]."""
    endpoints = []
    for pair in filter(None, (item.strip() for item in value.split(","))):
        request_endpoint, separator, heartbeat_endpoint = pair.partition("|")
        if not (separator and request_endpoint and heartbeat_endpoint) or "|" in heartbeat_endpoint:
            raise ImproperlyConfigured(f"SLUICE_WORKER_ENDPOINTS: expected 'request|heartbeat', got {pair!r}")
        endpoints.append((request_endpoint, heartbeat_endpoint))
    return endpoints


def _grammar_limits(environ: Mapping[str, str]) -> GrammarLimits:
    """The defaults of workers.protocol.messages.GrammarLimits, each overridden by SLUICE_GRAMMAR_<FIELD>."""
    names = {field: f"SLUICE_GRAMMAR_{field.upper()}" for field in GrammarLimits.__struct_fields__}
    overrides = {field: environ[name] for field, name in names.items() if name in environ}
    try:
        return msgspec.convert(overrides, GrammarLimits, strict=False)
    except msgspec.ValidationError as error:
        raise ImproperlyConfigured(f"SLUICE_GRAMMAR_*: {error}") from None


def _request_limits(environ: Mapping[str, str]) -> RequestLimits:
    """RequestLimits with each field from SLUICE_<FIELD> (e.g. SLUICE_MAX_TOOLS) where it is set; the
    defaults are recipe.limits'."""
    values = {}
    for field in dataclasses.fields(RequestLimits):
        name = f"SLUICE_{field.name.upper()}"
        if name in environ and field.name == "image_fetch_allowed_networks":
            values[field.name] = tuple(network.strip() for network in environ[name].split(",") if network.strip())
        elif name in environ:
            try:
                values[field.name] = int(environ[name])
            except ValueError:
                raise ImproperlyConfigured(f"{name}: expected an integer, got {environ[name]!r}") from None
    try:
        return RequestLimits(**values)
    except ValueError as error:
        raise ImproperlyConfigured(f"request limits (SLUICE_MAX_*): {error}") from None


def _positive_int(environ: Mapping[str, str], name: str, default: int) -> int:
    """The value of `name` in `environ`, else `default`, as an integer of at least 1."""
    raw = environ.get(name)
    try:
        value = int(raw) if raw is not None else default
    except ValueError:
        value = 0
    if value < 1:
        raise ImproperlyConfigured(f"{name}: expected a positive integer, got {raw!r}")
    return value


# Gateway. Model names are resolved like `workers.engine.weights.resolve_model` does (packaged name or path).
_models = os.environ.get("SLUICE_MODELS", "smollm2-135m-instruct")
SLUICE_MODELS = [name.strip() for name in _models.split(",") if name.strip()]
# Engine workers to send requests to; `manage.py serve` sets this for the workers it starts. None
# configured means every generation answers 503 and /healthz says so.
SLUICE_WORKER_ENDPOINTS = _worker_endpoints(os.environ.get("SLUICE_WORKER_ENDPOINTS", ""))
# Seconds between the gateway's looks at the topology for workers registered after it started (0: it
# routes to SLUICE_WORKER_ENDPOINTS only; `serve` sets 2, so the workers its node agent adds serve).
SLUICE_WORKER_DISCOVERY_INTERVAL_S = float(os.environ.get("SLUICE_WORKER_DISCOVERY_INTERVAL_S", 0))
# The global KV store's index when the workers share one (a redis:// URL; `serve` sets it): the
# gateway reads each prompt's hit length from it to weigh its prefill work. Empty: no index.
SLUICE_KV_STORE_INDEX = os.environ.get("SLUICE_KV_STORE_INDEX", "")

# State the gateways share (README, "Rate limits and quotas"): with a redis:// URL every gateway
# takes each tenant's rate limit from one token bucket in Redis and checks its daily token quota
# against one counter there; empty (the embedded default, one gateway) keeps both in the process and
# reads the quota from the usage rows. Keys are under SLUICE_REDIS_PREFIX.
SLUICE_REDIS_URL = os.environ.get("SLUICE_REDIS_URL", "")
SLUICE_REDIS_PREFIX = os.environ.get("SLUICE_REDIS_PREFIX", "sluice:gw")

# Bounds on API requests (README, "Request limits"). A body larger than this is refused with 413.
SLUICE_MAX_BODY_BYTES = int(os.environ.get("SLUICE_MAX_BODY_BYTES", 4 * 1024 * 1024))
# Django's own cap on request.body would otherwise be 2.5 MiB.
DATA_UPLOAD_MAX_MEMORY_SIZE = SLUICE_MAX_BODY_BYTES
# A body still arriving this long after its request began is refused with 408.
SLUICE_BODY_READ_TIMEOUT_S = float(os.environ.get("SLUICE_BODY_READ_TIMEOUT_S", 30))
# A connection that has not sent a whole request head (line and headers) this long after it opened,
# or after its previous response, is closed (uvicorn itself waits forever).
SLUICE_HEADER_READ_TIMEOUT_S = float(os.environ.get("SLUICE_HEADER_READ_TIMEOUT_S", 10))

# Nesting depth, counts and sizes in a request body (recipe.limits.RequestLimits), checked before any
# work is done for it; each refusal is a 400 naming the field. Image inputs too: SLUICE_MAX_IMAGES,
# SLUICE_MAX_IMAGE_BYTES, SLUICE_MAX_IMAGE_PIXELS and SLUICE_IMAGE_FETCH_TIMEOUT_S (recipe.images);
# SLUICE_IMAGE_FETCH_ALLOWED_NETWORKS, comma-separated CIDRs, lets image URLs reach those private
# networks (an operator's own image service; metadata addresses stay refused).
SLUICE_REQUEST_LIMITS = _request_limits(os.environ)
# What one request's output constraint (response_format / text.format json_schema or regex, tools)
# may cost a worker, sent with every constrained request: workers.protocol.messages.GrammarLimits lists the
# fields, their defaults and what each bounds. A grammar that does not compile within them is a 400;
# one that exceeds them while generating ends its own request with an error. Each field is
# overridden by SLUICE_GRAMMAR_<FIELD>, e.g. SLUICE_GRAMMAR_MAX_REGEX_REPEAT=4000 or
# SLUICE_GRAMMAR_STEP_LEXER_FUEL=400000.
SLUICE_GRAMMAR_LIMITS = _grammar_limits(os.environ)

# Fair admission (README, "Fair admission"). "0" turns it off: no per-tenant caps, and the gateway's
# preparation queues and the engines' waiting queues serve requests in arrival order, whoever sent them.
SLUICE_FAIR_ADMISSION = os.environ.get("SLUICE_FAIR_ADMISSION", "1") != "0"
# A tenant's caps where its own fields are empty (Tenant.max_requests_in_flight, .max_queued_prompt_tokens):
# API calls at once, from admission to the end of the response, and prompt tokens of its admitted
# requests still waiting for their first output token. Past either, a request is refused with 429 and
# `retry-after` of this many seconds (each cap frees as soon as one of the tenant's requests moves on).
# The in-flight default lets one client run a 64-stream load test; the token cap bounds the backlog.
SLUICE_TENANT_MAX_REQUESTS_IN_FLIGHT = _positive_int(os.environ, "SLUICE_TENANT_MAX_REQUESTS_IN_FLIGHT", 128)
SLUICE_TENANT_MAX_QUEUED_PROMPT_TOKENS = _positive_int(os.environ, "SLUICE_TENANT_MAX_QUEUED_PROMPT_TOKENS", 65536)
SLUICE_TENANT_CAP_RETRY_AFTER_S = _positive_int(os.environ, "SLUICE_TENANT_CAP_RETRY_AFTER_S", 1)
# Where request bodies are parsed, rendered and tokenized (controlplane.gateway.preparation): bodies up
# to SLUICE_PREPARE_INLINE_MAX_BYTES in this many gateway threads (a few milliseconds each)...
SLUICE_PREPARE_INLINE_MAX_BYTES = _positive_int(os.environ, "SLUICE_PREPARE_INLINE_MAX_BYTES", 16 * 1024)
SLUICE_PREPARE_THREADS = _positive_int(os.environ, "SLUICE_PREPARE_THREADS", 2)
# ...larger ones first in this many processes of their own, each job within a CPU budget (seconds of
# CPU, whole seconds as the kernel counts them); past it the request is refused with 413. The largest
# body SLUICE_MAX_BODY_BYTES allows takes about 10 s on one core of a small machine.
SLUICE_PREPARE_PROCESSES = _positive_int(os.environ, "SLUICE_PREPARE_PROCESSES", 2)
SLUICE_PREPARE_CPU_BUDGET_S = _positive_int(os.environ, "SLUICE_PREPARE_CPU_BUDGET_S", 30)
# Outputs a stream holds for a client that has stopped reading (on top of the server's socket buffers):
# once this many wait, its requests are aborted in the engines.
SLUICE_STREAM_BUFFER_OUTPUTS = _positive_int(os.environ, "SLUICE_STREAM_BUFFER_OUTPUTS", 256)

# Telemetry (controlplane.telemetry): the gateway keeps one-minute rollups this many days.
SLUICE_TELEMETRY_RETENTION_DAYS = int(os.environ.get("SLUICE_TELEMETRY_RETENTION_DAYS", 14))
