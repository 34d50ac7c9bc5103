"""The logger of access decisions: refusals, token file loads, the startup line.

It keeps the name ``leasekeeper_server.auth`` it had when these decisions
lived in one module: log filters and the ``logger`` field of JSON logs match it.
"""

from __future__ import annotations

import logging

log = logging.getLogger("leasekeeper_server.auth")
