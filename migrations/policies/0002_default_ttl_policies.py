"""The traffic classes every install starts with and their first TTLs (agent 3 days, chat 7 days)."""

from django.db import migrations

DAY_S = 86_400
DEFAULTS = {
    "agent": ("Agent loops: prefixes come back within minutes or not at all.", 3 * DAY_S),
    "chat": ("Chat: users come back days later. The default class for blocks of unnamed classes.", 7 * DAY_S),
}


def create_defaults(apps, schema_editor):
    TrafficClass = apps.get_model("policies", "TrafficClass")
    TTLPolicy = apps.get_model("policies", "TTLPolicy")
    for name, (description, ttl_seconds) in DEFAULTS.items():
        traffic_class, _ = TrafficClass.objects.get_or_create(name=name, defaults={"description": description})
        TTLPolicy.objects.get_or_create(
            traffic_class=traffic_class,
            version=1,
            defaults={"ttl_seconds": ttl_seconds, "created_by_label": "system", "reason": "initial default"},
        )


def delete_defaults(apps, schema_editor):
    TrafficClass = apps.get_model("policies", "TrafficClass")
    TTLPolicy = apps.get_model("policies", "TTLPolicy")
    TTLPolicy.objects.filter(traffic_class__name__in=DEFAULTS, version=1, created_by_label="system").delete()
    TrafficClass.objects.filter(name__in=DEFAULTS, ttl_policies__isnull=True).delete()


class Migration(migrations.Migration):
    dependencies = [("policies", "0001_initial")]

    operations = [migrations.RunPython(create_defaults, delete_defaults)]
