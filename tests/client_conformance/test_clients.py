"""Every conformance scenario against every client's driver, on a real server.

The scenarios are ``conformance/scenarios/*.yaml``, the drivers
``conformance/drivers.toml`` (one line per client); ``runner.py`` runs one
scenario with one driver. A driver whose client is not built is skipped, the
skip naming what is missing, unless it is required there or in
``LEASEKEEPER_CONFORMANCE_REQUIRE`` (CI requires every client it builds).
"""

from __future__ import annotations

import os

import pytest

from tests.client_conformance.runner import REQUIRE_ENV, DriverSpec, driver_params, load_drivers
from tests.client_conformance.runner import run_scenario as run
from tests.client_conformance.scenarios import Scenario, load_all

pytestmark = [pytest.mark.process, pytest.mark.timeout(90)]

SCENARIOS = load_all()


@pytest.mark.parametrize("driver", driver_params(load_drivers(), os.environ.get(REQUIRE_ENV)))
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[scenario.name for scenario in SCENARIOS])
async def test_client_passes_scenario(
    scenario: Scenario, driver: DriverSpec, database_url: str, namespace: str, tmp_path
) -> None:
    await run(scenario, driver, database_url, namespace, tmp_path)
