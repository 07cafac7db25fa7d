"""`python -m controlplane.manage COMMAND`: Django's management commands with sluice's settings. The
checkout's manage.py, the `sluice` console script and the children `serve` starts all run them here,
so none needs a checkout."""

import os
import sys


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv if argv is None else argv)


if __name__ == "__main__":
    main()
