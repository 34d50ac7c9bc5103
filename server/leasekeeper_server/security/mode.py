"""Whether this server asks for tokens, and the startup line that says so.

``LEASEKEEPER_AUTH=auto`` (the default) asks for tokens unless the listen
address is loopback only; the startup line warns when the port is open to
anyone, or when tokens would travel in clear text.
"""

from __future__ import annotations

import ipaddress

from leasekeeper_server.security.access_log import log
from leasekeeper_server.settings import Settings


def is_loopback(listen: str) -> bool:
    """Whether a ``host:port`` listen address is loopback only (127.0.0.0/8, ::1, localhost)."""
    host = listen.rpartition(":")[0] if ":" in listen else listen
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def auth_enabled(settings: Settings) -> bool:
    """Whether calls need a token: ``auth`` on, or ``auto`` on a non-loopback listen address."""
    if settings.auth == "auto":
        return not is_loopback(settings.listen)
    return settings.auth == "on"


def log_startup(settings: Settings, tls: bool) -> None:
    """Logs how calls are authenticated, warning when the port is open to anyone."""
    loopback = is_loopback(settings.listen)
    if not auth_enabled(settings):
        if loopback:
            log.info("authentication off (%s is loopback only)", settings.listen)
        else:
            log.warning(
                "authentication is OFF on %s: anyone who can reach the port can take and "
                "revoke leases; set LEASEKEEPER_AUTH=on (or auto) and create tokens",
                settings.listen,
            )
        return
    if settings.tokens_file:
        log.info(
            "authentication on: tokens from %s and from the database (leasekeeper tokens)",
            settings.tokens_file,
        )
    else:
        log.info("authentication on: tokens from the database (leasekeeper tokens create)")
    if not tls and not loopback:
        log.warning(
            "authentication on without TLS on %s: tokens travel in clear text; "
            "set LEASEKEEPER_TLS_CERT_FILE and LEASEKEEPER_TLS_KEY_FILE",
            settings.listen,
        )
