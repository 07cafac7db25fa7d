from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("telemetry", "0005_decode_load_rollup"),
    ]

    operations = [
        migrations.AddField(
            model_name="telemetryrollup",
            name="engine_steps",
            field=models.PositiveBigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="telemetryrollup",
            name="engine_step_seconds",
            field=models.FloatField(default=0.0),
        ),
        migrations.AddField(
            model_name="telemetryrollup",
            name="kv_handoffs",
            field=models.PositiveBigIntegerField(default=0),
        ),
        migrations.AddField(
            model_name="telemetryrollup",
            name="kv_handoff_seconds",
            field=models.FloatField(default=0.0),
        ),
    ]
