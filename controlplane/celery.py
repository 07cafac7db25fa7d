"""The Celery app; configuration comes from Django settings named CELERY_*."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("sluice")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Finds controlplane/<app>/tasks.py of every installed app.
app.autodiscover_tasks()
