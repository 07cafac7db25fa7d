from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("telemetry", "0004_kv_store_gc"),
    ]

    operations = [
        migrations.CreateModel(
            name="DecodeLoadRollup",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("pool", models.CharField(max_length=100)),
                ("minute", models.DateTimeField()),
                ("peak_requests_in_flight", models.PositiveIntegerField()),
                ("peak_kv_tokens", models.PositiveBigIntegerField()),
            ],
            options={
                "ordering": ["minute"],
                "constraints": [models.UniqueConstraint(fields=("pool", "minute"), name="decodeload_unique_minute")],
            },
        ),
    ]
