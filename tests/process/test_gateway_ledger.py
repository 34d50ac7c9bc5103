"""The effect gateway's own fence check: its ledger, without processes or a lease service."""

from __future__ import annotations

import pytest
from gateway import Ledger, read_sends

from leasekeeper import FenceRef


@pytest.fixture
def ledger(tmp_path):
    opened = Ledger(tmp_path / "ledger.sqlite3")
    yield opened
    opened.close()


def test_record_send_lower_fence_after_higher_is_refused(ledger, tmp_path):
    assert ledger.record_send(FenceRef("ns", "t", 2), "summary", "from B").status == "accepted"
    refused = ledger.record_send(FenceRef("ns", "t", 1), "other", "from A")
    assert (refused.status, refused.send_id, refused.highest_fence) == ("refused", None, 2)
    assert [row["fence"] for row in read_sends(tmp_path / "ledger.sqlite3")] == [2]


def test_record_send_same_effect_key_twice_is_duplicate(ledger, tmp_path):
    first = ledger.record_send(FenceRef("ns", "t", 1), "summary", "once")
    again = ledger.record_send(FenceRef("ns", "t", 3), "summary", "twice")
    assert (again.status, again.send_id) == ("duplicate", first.send_id)
    assert len(read_sends(tmp_path / "ledger.sqlite3")) == 1


@pytest.mark.parametrize(
    ("first", "second", "status"),
    [(1, 1, "accepted"), (1, 2, "accepted"), (3, 2, "refused")],
)
def test_record_send_fence_order_decides(ledger, first, second, status):
    ledger.record_send(FenceRef("ns", "t", first), "a", "first")
    assert ledger.record_send(FenceRef("ns", "t", second), "b", "second").status == status


def test_record_send_fences_are_per_task(ledger):
    ledger.record_send(FenceRef("ns", "t1", 5), "a", "first")
    assert ledger.record_send(FenceRef("ns", "t2", 1), "a", "other task").status == "accepted"
    assert ledger.record_send(FenceRef("ns2", "t1", 1), "a", "other ns").status == "accepted"
