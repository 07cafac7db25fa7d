"""Django settings. Embedded default: SQLite under var/; set DATABASE_URL for PostgreSQL."""

import os
from pathlib import Path

from controlplane.database_url import parse_database_url

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
]

# Our apps keep their migrations in the top-level migrations/ package.
SLUICE_APPS: list[str] = []
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

if "DATABASE_URL" not in os.environ:
    VAR_DIR.mkdir(parents=True, exist_ok=True)
DATABASES = {"default": parse_database_url(os.environ.get("DATABASE_URL", f"sqlite:///{VAR_DIR / 'sluice.sqlite3'}"))}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"
