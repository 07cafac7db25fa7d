"""Whether the database holds the tables this code needs, for management commands: one that needs
them says in one line what to run on a database that lacks migrations, instead of failing deep
inside with a traceback, and `serve` migrates the embedded default itself."""

from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.db.migrations.executor import MigrationExecutor

MIGRATE = "python manage.py migrate"


def pending_migrations() -> int:
    """How many migrations the database lacks. A database that cannot be read is a CommandError
    naming the problem (its first line: drivers' messages run on with hints)."""
    try:
        executor = MigrationExecutor(connections[DEFAULT_DB_ALIAS])
        return len(executor.migration_plan(executor.loader.graph.leaf_nodes()))
    except DatabaseError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CommandError(f"cannot read the database (DATABASE_URL): {first_line}") from None


class MigratedDatabaseCommand(BaseCommand):
    """A command that needs the control plane's tables: on a database that lacks migrations it exits
    with code 1 and one line saying to run `python manage.py migrate` (Django's own check only warns)."""

    requires_migrations_checks = True

    def check_migrations(self) -> None:
        pending = pending_migrations()
        if pending:
            raise CommandError(f"the database is not set up ({pending} migrations not applied): run `{MIGRATE}` first")
