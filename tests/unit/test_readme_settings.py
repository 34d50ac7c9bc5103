"""The README's configuration table names every setting the server reads."""

from __future__ import annotations

import re
from pathlib import Path

from leasekeeper_server.settings import Settings

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_setting_is_in_the_readme_configuration_table():
    text = README.read_text("utf-8")
    section = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    documented = {name.lower() for name in re.findall(r"`LEASEKEEPER_([A-Z0-9_]+)`", section)}
    missing = sorted(set(Settings.model_fields) - documented)
    assert not missing, f"settings missing from the README's Configuration table: {missing}"
    unknown = sorted(documented - set(Settings.model_fields))
    assert not unknown, f"the README documents settings that do not exist: {unknown}"
