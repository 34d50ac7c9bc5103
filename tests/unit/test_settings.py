"""Settings refuse combinations the server could not honour."""

from __future__ import annotations

import pydantic
import pytest

from leasekeeper_server.settings import Settings


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"min_ttl_s": 10.0, "default_ttl_s": 5.0}, "min_ttl_s <= default_ttl_s"),
        ({"default_ttl_s": 7200.0}, "default_ttl_s <= max_ttl_s"),
        ({"max_runtime_s": 0.5}, "min_ttl_s <= max_runtime_s"),
        ({"pool_min_size": 5, "pool_max_size": 2}, "pool_min_size <= pool_max_size"),
        ({"max_id_bytes": 641}, "less than or equal to 640"),
        ({"listen": "0.0.0.0:94517"}, "(?s)listen.*port in 0..65535"),
        ({"metrics_listen": "0.0.0.0:-1"}, "(?s)metrics_listen.*port in 0..65535"),
        ({"health_listen": "9459"}, "(?s)health_listen.*not host:port"),
        # asyncpg's own DSN parser judges the URL; 99999 it accepts, TCP does not.
        ({"database_url": "postgres://u@h:notaport/db"}, "(?s)database_url.*notaport"),
        ({"database_url": "nonsense"}, "(?s)database_url.*scheme"),
        ({"database_url": "mysql://x"}, "(?s)database_url.*mysql"),
        ({"database_url": "postgresql://u@h/db?sslmode=bogus"}, "(?s)database_url.*sslmode"),
        ({"database_url": "postgresql://u@h:99999/db"}, "(?s)database_url.*port 99999"),
    ],
)
def test_settings_impossible_combination_refused(overrides, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        Settings(_env_file=None, **overrides)  # type: ignore[call-arg]


def test_settings_from_environment_read_with_prefix(monkeypatch):
    monkeypatch.setenv("LEASEKEEPER_DEFAULT_TTL_S", "12.5")
    monkeypatch.setenv("LEASEKEEPER_LISTEN", "0.0.0.0:1234")
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    assert settings.default_ttl_s == 12.5
    assert settings.listen == "0.0.0.0:1234"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u@h:5432/db",
        "postgres://u:secret@[::1]/db?sslmode=require",
        "postgresql://u@h1:5432,h2:5433/db",
        "postgresql:///db?host=/run/postgresql",
    ],
)
def test_settings_database_url_asyncpg_accepts_is_kept(url):
    assert Settings(_env_file=None, database_url=url).database_url == url  # type: ignore[call-arg]
