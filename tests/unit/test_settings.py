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
