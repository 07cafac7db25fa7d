import pytest

from controlplane.database_url import DatabaseUrlError, parse_database_url


def test_postgres_url_names_its_parts():
    parsed = parse_database_url("postgres://user:p%40ss@db.example:6432/sluice?sslmode=require")

    assert parsed["ENGINE"] == "django.db.backends.postgresql"
    assert (parsed["NAME"], parsed["USER"], parsed["PASSWORD"]) == ("sluice", "user", "p@ss")
    assert (parsed["HOST"], parsed["PORT"], parsed["OPTIONS"]) == ("db.example", "6432", {"sslmode": "require"})


def test_sqlite_url_waits_for_the_lock_instead_of_failing(tmp_path):
    parsed = parse_database_url(f"sqlite:///{tmp_path}/sluice.sqlite3")

    assert parsed["NAME"] == f"{tmp_path}/sluice.sqlite3"
    assert parsed["OPTIONS"]["timeout"] > 0
    assert parsed["OPTIONS"]["transaction_mode"] == "IMMEDIATE"
    assert "journal_mode=WAL" in parsed["OPTIONS"]["init_command"]


@pytest.mark.parametrize("url", ["postgres://127.0.0.1:5432/", "sqlite://", "mysql://localhost/sluice"])
def test_unusable_urls_are_refused(url):
    with pytest.raises(DatabaseUrlError):
        parse_database_url(url)
