from django.db import migrations, models

# The vision-encoder pool kind was stored as "ve"; workers of that pool run with role "encode", and a
# worker joins only a pool of its own role's kind, so the kind is spelled as the role.
RENAMED = {"ve": "encode"}


def _rename(apps, names: dict[str, str]) -> None:
    pool = apps.get_model("topology", "Pool")
    for old, new in names.items():
        pool.objects.filter(kind=old).update(kind=new)


def forwards(apps, schema_editor) -> None:
    _rename(apps, RENAMED)


def backwards(apps, schema_editor) -> None:
    _rename(apps, {new: old for old, new in RENAMED.items()})


class Migration(migrations.Migration):
    dependencies = [
        ("topology", "0004_pool_precision"),
    ]

    operations = [
        migrations.AlterField(
            model_name="pool",
            name="kind",
            field=models.CharField(
                choices=[
                    ("encode", "vision encoder"),
                    ("prefill", "prefill"),
                    ("decode", "decode"),
                    ("mixed", "mixed (prefill + decode)"),
                ],
                max_length=10,
            ),
        ),
        migrations.RunPython(forwards, backwards),
    ]
