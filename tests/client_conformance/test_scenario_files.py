"""The conformance suite's files: scenarios valid, documented, drivers listed; no server needed.

The scenarios' table in docs/reference/conformance.md is made from the scenario files and
compared here; every command and event the scenarios may use is in PROTOCOL.md; a malformed
scenario or drivers file is refused naming the field; a driver whose client is not built is
skipped with the missing path named, unless it is required.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.client_conformance.runner import (
    DriverSpec,
    driver_params,
    load_drivers,
    matches,
)
from tests.client_conformance.scenarios import (
    COMMANDS,
    EVENTS,
    ROOT,
    SCENARIO_DIR,
    ScenarioError,
    load,
    load_all,
    markdown_table,
)

DOCS_PAGE = ROOT / "docs" / "reference" / "conformance.md"
PROTOCOL = ROOT / "conformance" / "PROTOCOL.md"
TABLE = re.compile(r"<!-- scenarios:[^\n]*-->\n(?P<table>.*?)<!-- /scenarios -->", re.S)
REQUIRED_SCENARIOS = {
    "paused-worker",
    "late-grant",
    "lost-reply",
    "revoke-pushed",
    "cancelled-run",
    "checkpoint-resume",
    "in-doubt-reconciled",
}


def test_every_scenario_file_loads_and_the_issue_scenarios_are_there():
    names = {scenario.name for scenario in load_all()}
    assert REQUIRED_SCENARIOS <= names
    assert len(names) == len(list(SCENARIO_DIR.glob("*.yaml")))


def test_docs_table_is_the_one_made_from_the_scenario_files():
    found = TABLE.search(DOCS_PAGE.read_text())
    assert found, "docs/reference/conformance.md: no <!-- scenarios --> table"
    expected = markdown_table(load_all())
    assert found.group("table") == expected, (
        "the scenarios' table is stale; replace it with:\n" + expected
    )


def test_docs_example_is_the_scenario_file_itself():
    page = DOCS_PAGE.read_text()
    example = re.search(r"```yaml\n(?P<body>title: A revoke is pushed\n.*?)```", page, re.S)
    assert example, "docs/reference/conformance.md: the revoke scenario's yaml block"
    assert example.group("body") == (SCENARIO_DIR / "revoke-pushed.yaml").read_text()


def test_protocol_names_every_command_and_event():
    text = PROTOCOL.read_text()
    for name in (*COMMANDS, "exit"):
        assert f"| `{name}` |" in text, f"PROTOCOL.md: command {name} has no row"
    for name in EVENTS:
        assert f"| `{name}` |" in text, f"PROTOCOL.md: event {name} has no row"


def test_scenarios_use_only_events_the_protocol_defines():
    text = "\n".join(path.read_text() for path in SCENARIO_DIR.glob("*.yaml"))
    used = set(re.findall(r"event: (\w+)", text))
    assert used <= set(EVENTS), used - set(EVENTS)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ("steps: [{send: {worker: a, cmd: hold, task_id: t}}]", "ttl_s"),
        ("steps: [{send: {worker: a, cmd: fly}}]", "cmd"),
        ("steps: [{send: {worker: a, cmd: release}, expect: {event: landed}}]", "event"),
        ("steps: [{expect: {worker: z, event: lost}}]", "worker 'z'"),
        ("steps: [{hop: 1}]", "a step has exactly one of send, expect, do, wait, check, never"),
        ("steps: [{check: {lease: t}, wait: {lease: t}}]", "exactly one of"),
        ("steps: [{do: proxy, fault: delay}]", "seconds"),
        ("steps: [{check: {history: t, where: {kind: GRANTED}}}]", "count, equals"),
        ("steps: [{do: pause, worker: a, signal: 9}]", "signal"),
        ("steps: [{wait: {nothing: 1}}]", "a check names exactly one of"),
    ],
)
def test_malformed_scenario_is_refused_naming_the_field(tmp_path: Path, body: str, named: str):
    path = tmp_path / "bad.yaml"
    path.write_text(f"title: t\nsummary: s\nworkers: [a]\n{body}\n")
    with pytest.raises(ScenarioError) as refused:
        load(path)
    assert "bad.yaml" in str(refused.value)
    assert named in str(refused.value)


def test_drivers_file_lists_the_python_driver_as_required():
    drivers = {driver.name: driver for driver in load_drivers()}
    python = drivers["python"]
    assert python.required
    assert python.missing() == []
    assert (ROOT / python.command[1]).is_file()


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("drivers = []", "drivers"),
        ('drivers = [{ name = "Py", command = ["x"] }]', "drivers[0].name"),
        ('drivers = [{ name = "py", command = [] }]', "drivers[0].command"),
        ('drivers = [{ name = "py", command = ["x"], needs = "dist" }]', "drivers[0].needs"),
        ('drivers = [{ name = "py", command = ["x"], flavour = 1 }]', "unknown keys"),
        ('drivers = [{ name = "a", command = ["x"] }, { name = "a", command = ["y"] }]', "once"),
    ],
)
def test_malformed_drivers_file_is_refused_naming_the_field(tmp_path: Path, text: str, named: str):
    path = tmp_path / "drivers.toml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match=re.escape(named)):
        load_drivers(path)


def test_driver_not_built_is_skipped_naming_the_path_unless_required(tmp_path: Path):
    (tmp_path / "built").mkdir()
    built = DriverSpec("built", ("node", "d.mjs"), needs=("built",))
    absent = DriverSpec("absent", ("node", "d.mjs"), needs=("built", "dist/index.js"))
    pinned = DriverSpec("pinned", ("node", "d.mjs"), needs=("dist/index.js",), required=True)

    def skips(required_env: str | None) -> dict[str, str | None]:
        params = driver_params([built, absent, pinned], required_env, root=tmp_path)
        return {
            param.id: next((mark.kwargs["reason"] for mark in param.marks), None)
            for param in params
        }

    assert skips(None) == {
        "built": None,
        "absent": "the absent client is not built: dist/index.js missing",
        "pinned": None,
    }
    assert skips("absent") == {"built": None, "absent": None, "pinned": None}
    with pytest.raises(ValueError, match="no driver named nobody"):
        driver_params([built], "nobody", root=tmp_path)


@pytest.mark.parametrize(
    ("expected", "actual", "result"),
    [
        ({"event": "lost", "reason": "X"}, {"event": "lost", "reason": "X", "id": 1}, True),
        ({"event": "lost", "reason": "X"}, {"event": "lost", "reason": "Y"}, False),
        ({"reason": {"one_of": ["A", "B"]}}, {"reason": "B"}, True),
        ({"reason": {"one_of": ["A", "B"]}}, {"reason": "C"}, False),
        ({"checkpoint": None}, {"checkpoint": {"version": 1}}, False),
        ({"checkpoint": {"version": 2}}, {"checkpoint": {"version": 2, "data": "x"}}, True),
        ({"checkpoint": {"version": 2}}, {"checkpoint": None}, False),
        ({"owner_id": {"owner_of": "a"}}, {"owner_id": "owner-a"}, True),
        ({"owner_id": {"owner_of": "b"}}, {"owner_id": "owner-a"}, False),
        ({"reconcile": True}, {"reconcile": 1}, False),
        ({"fence": 1}, {}, False),
    ],
)
def test_matches(expected, actual, result):
    assert matches(expected, actual, {"a": "owner-a", "b": None}) is result
