"""The alert rules and the metrics page name only what a real server exports.

``deploy/prometheus/alerts.yaml`` is a Prometheus rule file; every series an alert's
expression selects must be one a real server's scrape has (``up``, which Prometheus
makes for each target, aside), with label matchers on labels that series has, and
every alert has its entry in ``docs/operations/runbook.md`` (a heading with the
alert's name, which its ``runbook_url`` points at), and every entry its alert.

``docs/operations/metrics.md`` has a table of every metric with its type and labels:
it must list exactly the families a real scrape exports, with exactly their labels.
The server is driven until every family has a series (an expiry, a quarantine, a
revoke, a recovery, a cancel, a checkpoint, a namespace limit), so each family's
labels are read from real samples, never from the code.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from tests.conftest import RunningServer, running_server
from tests.helpers import dur, poll
from tests.integration.test_expiry_announced import sweeper_lock_free
from tests.integration.test_metrics_http import scrape_text

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"
RUNBOOK = ROOT / "docs" / "operations" / "runbook.md"
METRICS_PAGE = ROOT / "docs" / "operations" / "metrics.md"
RUNBOOK_PATH = "docs/operations/runbook.md"

SEVERITIES = {"critical", "warning", "info"}
# Series Prometheus makes itself for each target, and the labels it gives every series.
PROMETHEUS_SERIES = {"up"}
TARGET_LABELS = {"job", "instance"}


# --- the rule file and the runbook ---------------------------------------------------------


def rules() -> list[dict]:
    """Every rule of the rule file, in order."""
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def runbook_url(anchor: str) -> str:
    """Where an alert's runbook entry is: the runbook on the repository's page, at its anchor."""
    # mkdocs.yml holds python/name tags (Markdown extensions' hooks): read the one key plainly.
    match = re.search(r"^repo_url:\s*(\S+)", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert match is not None, "mkdocs.yml has no repo_url"
    repo_url = match.group(1).rstrip("/")
    return f"{repo_url}/blob/main/{RUNBOOK_PATH}#{anchor}"


def runbook_entries() -> list[str]:
    """The alert names the runbook has entries for: its second-level headings named Leasekeeper*."""
    return re.findall(r"^## (Leasekeeper\w+)\s*$", RUNBOOK.read_text(), re.M)


def test_the_rule_file_is_a_prometheus_rule_file() -> None:
    document = yaml.safe_load(RULES.read_text())
    assert set(document) == {"groups"}
    names = [group["name"] for group in document["groups"]]
    assert len(names) == len(set(names)), "group names must be unique"
    alerts = [rule["alert"] for rule in rules()]
    assert alerts, "no alert"
    assert len(alerts) == len(set(alerts)), "alert names must be unique"
    for rule in rules():
        name = rule.get("alert")
        assert re.fullmatch(r"Leasekeeper[A-Z][A-Za-z]+", name or ""), rule
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, name
        assert isinstance(rule["expr"], str) and rule["expr"].strip(), name
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), name
        assert rule["labels"]["severity"] in SEVERITIES, name
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, name
        assert annotations["runbook_url"] == runbook_url(name.lower()), name


def test_every_alert_has_a_runbook_entry_and_every_entry_an_alert() -> None:
    alerts = [rule["alert"] for rule in rules()]
    entries = runbook_entries()
    assert len(entries) == len(set(entries)), "an alert has two runbook entries"
    assert set(alerts) - set(entries) == set(), "alerts without a runbook entry"
    assert set(entries) - set(alerts) == set(), "runbook entries without an alert"
    assert entries == alerts, "the runbook's entries are not in the rule file's order"


def test_each_runbook_entry_quotes_its_rule_as_the_rule_file_has_it() -> None:
    text = RUNBOOK.read_text()
    for rule in rules():
        entry = text.split(f"## {rule['alert']}\n", 1)[1].split("\n## ", 1)[0]
        quoted = re.search(r"```yaml\n(.*?)```", entry, re.S)
        assert quoted, f"{rule['alert']}: the entry quotes no rule"
        shown = yaml.safe_load(quoted.group(1))
        expected = {key: value for key, value in rule.items() if key != "annotations"}
        assert shown == [expected], f"{rule['alert']}: the entry's rule differs from the file's"


# --- PromQL: the series an expression selects ------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_SELECTOR = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)\s*(\{[^}]*\})?\s*(\()?")
_MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_KEYWORDS = {"and", "or", "unless", "bool", "offset"}


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """The series an expression selects: ``(metric name, label names matched)`` each.

    Strings, range brackets and grouping clauses (``by (...)``, ``on (...)``, ...)
    are removed first; an identifier followed by ``(`` is a function or an
    aggregation, and binary operators' keywords are no metrics.
    """
    text = _STRING.sub('""', expr)
    text = _RANGE.sub("", text)
    text = _GROUPING.sub(" ", text)
    found = []
    for match in _SELECTOR.finditer(text):
        name, braces, call = match.groups()
        if call or name in _KEYWORDS:
            continue
        found.append((name, set(_MATCHER.findall(braces or ""))))
    return found


def test_selectors_finds_the_series_of_an_expression() -> None:
    expr = (
        'sum by (instance, le) (rate(a_bucket{code="OK",method=~"Renew|X"}[5m]))'
        ' / on (instance) max(b) > 0.5 or absent(up{job="x"} == 1)'
    )
    assert selectors(expr) == [
        ("a_bucket", {"code", "method"}),
        ("b", set()),
        ("up", {"job"}),
    ]


# --- a real scrape, with every family's series present ---------------------------------------


@dataclass
class Family:
    """A metric family of a real scrape: its type, labels and the series names it exports."""

    type: str
    labels: set[str]
    series: set[str]


def series_names(name: str, kind: str) -> set[str]:
    """The names a family's samples have in Prometheus (its ``_created`` aside)."""
    if kind == "counter":
        return {name + "_total"}
    if kind == "histogram":
        return {name + suffix for suffix in ("_bucket", "_count", "_sum")}
    return {name}


def families_of(text: str) -> dict[str, Family]:
    """The ``leasekeeper_`` families of a scrape's text, by family name."""
    found: dict[str, Family] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("leasekeeper_") or family.name.endswith("_created"):
            continue
        labels = {label for sample in family.samples for label in sample.labels} - {"le"}
        found[family.name] = Family(family.type, labels, series_names(family.name, family.type))
    return found


# The families whose series appear only once something happened in a namespace.
BY_NAMESPACE = (
    "leasekeeper_claims",
    "leasekeeper_leases_expired",
    "leasekeeper_leases_lost",
    "leasekeeper_recovery_seconds",
    "leasekeeper_tasks_quarantined",
    "leasekeeper_tasks_cancelled",
    "leasekeeper_checkpoint_writes",
    "leasekeeper_checkpoint_bytes",
    "leasekeeper_leases_held",
    "leasekeeper_namespace_max_leases",
    "leasekeeper_namespace_claims_per_second",
    "leasekeeper_namespace_lock_delay_seconds",
    "leasekeeper_limit_rejections",
)


@pytest.fixture
async def leader(database_url: str, db: asyncpg.Connection) -> AsyncIterator[RunningServer]:
    """A server with a metrics endpoint that is the database's elected sweeper (sweeps 0.1 s)."""
    await poll(lambda: sweeper_lock_free(db), "the sweeper lock released")
    async with running_server(
        database_url, metrics_listen="127.0.0.1:0", sweep_interval_s=0.1
    ) as running:

        async def elected() -> bool:
            assert running.server.sweeper is not None
            return running.server.sweeper.is_leader

        await poll(elected, "this server elected sweeper")
        yield running


async def scrape_with_every_family(
    running: RunningServer, namespace: str, db: asyncpg.Connection
) -> dict[str, Family]:
    """Drives the server until every family has a series; returns a scrape's families."""
    await db.execute(
        "INSERT INTO leasekeeper_namespace_limits (namespace, max_leases, claims_per_second,"
        " lock_delay) VALUES ($1, 100, 1000, interval '0 seconds')",
        namespace,
    )
    async with grpc.aio.insecure_channel(running.target) as channel:
        stub = rpc.LeaseServiceStub(channel)

        async def claim(task_id: str, owner_id: str, ttl_s: float, **kw: object) -> pb.Lease:
            reply = await stub.Claim(
                pb.ClaimRequest(
                    namespace=namespace, task_id=task_id, owner_id=owner_id, ttl=dur(ttl_s), **kw
                )
            )
            assert reply.acquired, reply
            return reply.lease

        def task(task_id: str) -> dict[str, str]:
            return {"namespace": namespace, "task_id": task_id}

        # An expiry that uses up the last attempt: expired, lost, quarantined.
        await claim("poison", "owner-a", 0.2, max_attempts=1)
        # A revoke of a live lease, then a new grant: lost, time in recovery.
        await claim("revoked", "owner-a", 30.0)
        await stub.Revoke(pb.RevokeRequest(**task("revoked"), reason="test"))
        lease = await claim("revoked", "owner-b", 30.0)
        # A checkpoint: writes and bytes, by method.
        await stub.SaveCheckpoint(
            pb.SaveCheckpointRequest(
                **task("revoked"),
                owner_id="owner-b",
                fence=lease.fence,
                checkpoint=pb.Checkpoint(version=1, data=b"step 1"),
            )
        )
        # A cancel: cancelled.
        await claim("cancelled", "owner-a", 30.0)
        await stub.Cancel(pb.CancelRequest(**task("cancelled"), reason="test"))

        async def complete() -> dict[str, Family] | None:
            text = await asyncio.to_thread(scrape_text, running.server.metrics_port)
            families = families_of(text)
            seen = all("namespace" in families[name].labels for name in BY_NAMESPACE)
            return families if seen else None

        families: dict[str, Family] = await poll(
            complete, "a series of every family by namespace", within_s=20
        )
    return families


# --- the metrics page's table ---------------------------------------------------------------

_ROW = re.compile(r"^\| `(leasekeeper_\w+)` \| (\w+) \|([^|]*)\|", re.M)


def documented_metrics() -> dict[str, tuple[str, set[str]]]:
    """The metrics page's table: ``{family name: (type, labels)}``.

    A row names a counter by its series (``..._total``), a histogram or a gauge by its
    family name; labels are the backticked names of its third cell.
    """
    documented: dict[str, tuple[str, set[str]]] = {}
    for name, kind, labels in _ROW.findall(METRICS_PAGE.read_text()):
        family = name.removesuffix("_total") if kind == "counter" else name
        assert family not in documented, f"{name} is listed twice"
        documented[family] = (kind, set(re.findall(r"`(\w+)`", labels)))
    assert documented, "the metrics page has no table of metrics"
    return documented


async def test_the_metrics_page_lists_exactly_the_families_a_real_server_exports(
    leader: RunningServer, namespace: str, db: asyncpg.Connection
) -> None:
    exported = await scrape_with_every_family(leader, namespace, db)
    documented = documented_metrics()
    assert set(exported) - set(documented) == set(), "exported, not on the metrics page"
    assert set(documented) - set(exported) == set(), "on the metrics page, not exported"
    for name, family in exported.items():
        assert documented[name] == (family.type, family.labels), name


async def test_alert_expressions_select_only_series_a_real_server_exports(
    leader: RunningServer, namespace: str, db: asyncpg.Connection
) -> None:
    exported = await scrape_with_every_family(leader, namespace, db)
    labels_of = {
        series: family.labels | TARGET_LABELS | ({"le"} if series.endswith("_bucket") else set())
        for family in exported.values()
        for series in family.series
    }
    for rule in rules():
        found = selectors(rule["expr"])
        assert any(
            name.startswith("leasekeeper_") or name in PROMETHEUS_SERIES for name, _ in found
        )
        for name, matched in found:
            if name in PROMETHEUS_SERIES:
                assert matched <= TARGET_LABELS, (rule["alert"], name, matched)
                continue
            assert name in labels_of, f"{rule['alert']}: {name} is not a series a server exports"
            assert matched <= labels_of[name], (rule["alert"], name, matched - labels_of[name])
