"""The typed batched statements and the SQL loader's fragments, without a database."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

from leasekeeper_server.core.model import TaskKey
from leasekeeper_server.storage import queries
from leasekeeper_server.storage.outcomes import StatementOutcomes
from leasekeeper_server.storage.statements import (
    BatchedStatement,
    ClaimParams,
    RenewParams,
    unnest_names,
)


def statement(name: str, params: type[Any]) -> BatchedStatement[Any]:
    pool: Any = None  # not used until a batch is sent
    return BatchedStatement(
        name,
        queries.load(),
        params,
        pool,
        connect_timeout_s=1.0,
        outcomes=StatementOutcomes(),
        tick_s=0.0,
    )


@pytest.mark.parametrize(
    ("name", "params"), [("claim", ClaimParams), ("renew", RenewParams), ("get_leases", TaskKey)]
)
def test_each_batched_statement_names_its_arrays_as_its_parameters_do(name, params):
    assert statement(name, params).fields == queries_unnest(name)


def queries_unnest(name: str) -> tuple[str, ...]:
    return unnest_names(queries.load()[name])


def test_parameters_out_of_the_statements_order_are_refused_at_start():
    @dataclass(frozen=True, slots=True)
    class Swapped:
        namespace: str
        task_id: str
        fence: int  # the statement takes owner_id here
        owner_id: str
        ttl: timedelta

    with pytest.raises(ValueError, match=r"Swapped fields .* are not statement 'renew'"):
        statement("renew", Swapped)


def test_a_batch_becomes_one_array_per_parameter_in_order():
    renewals = [
        RenewParams("ns", "a", "w1", 3, timedelta(seconds=5)),
        RenewParams("ns", "b", "w2", 7, None, 2, b"cp", "text/plain"),
    ]
    assert statement("renew", RenewParams).arrays(renewals) == [
        ["ns", "ns"],
        ["a", "b"],
        ["w1", "w2"],
        [3, 7],
        [timedelta(seconds=5), None],
        [None, 2],
        [None, b"cp"],
        [None, "text/plain"],
    ]


def test_fragments_are_put_in_place_with_their_instant():
    sql = queries.parse(
        "-- fragment: live\n(t.expire_time > @now)\n"
        "-- name: a\nSELECT {{live}}\n"
        "-- name: b\nSELECT {{live:c.db_now}}\n"
    )
    assert sql == {
        "a": "SELECT (t.expire_time > clock_timestamp())",
        "b": "SELECT (t.expire_time > c.db_now)",
    }


def test_a_fragment_used_but_not_defined_is_refused():
    with pytest.raises(ValueError, match="fragment 'missing' is used but not defined"):
        queries.parse("-- name: a\nSELECT {{missing}}\n")


def test_every_service_statement_has_its_fragments_in_place():
    assert not [name for name, sql in queries.load().items() if "{{" in sql or "@now" in sql]
