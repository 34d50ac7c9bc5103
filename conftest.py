"""Collects the README's and the docs' code blocks as tests (rules: tests/docs/blocks.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator

import pytest
from sybil import Sybil

from leasekeeper_server.storage.migrate import migrate
from tests.conftest import _embedded_database, _local_database, _local_postgres_answers
from tests.docs.blocks import DocumentBlocks
from tests.docs.service import DocsService, docs_service


@pytest.fixture(scope="session")
def docs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocsService]:
    """The service every snippet runs against, on a database of its own (emptied per page)."""
    with contextlib.ExitStack() as stack:
        if os.environ.get("LEASEKEEPER_TEST_EMBEDDED") != "1" and asyncio.run(
            _local_postgres_answers()
        ):
            url = stack.enter_context(_local_database())
        else:
            url = stack.enter_context(_embedded_database(tmp_path_factory.mktemp("docs-pg")))
        asyncio.run(migrate(url))
        yield stack.enter_context(docs_service(url, tmp_path_factory.mktemp("docs-server")))


pytest_collect_file = Sybil(
    parsers=[DocumentBlocks()],
    patterns=["README.md", "docs/*.md", "docs/**/*.md"],
    fixtures=["docs"],
).pytest()
