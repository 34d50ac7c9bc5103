"""Service settings, read from the environment (``LEASEKEEPER_*``) and a ``.env`` file.

Every duration is in seconds and says so in its name (``_s``). Bounds are
checked at start-up: a server never starts with settings it cannot honour.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_data_dir() -> Path:
    """Where the embedded PostgreSQL keeps its data: the user's data directory."""
    import platformdirs

    return Path(platformdirs.user_data_dir("leasekeeper")) / "pgdata"


def database_url_problem(url: str) -> str | None:
    """What makes ``url`` a URL asyncpg can never connect with, or None.

    asyncpg's own DSN parser judges it (the one ``asyncpg.connect`` runs, with
    the ``PG*`` environment variables it also reads), so the rule is the
    driver's; only the ports it returns are checked further (1..65535: it
    accepts 99999, which a connection would silently wrap). When this asyncpg
    does not expose its parser with the expected keyword arguments, nothing is
    said here and a connection reports the same problem (store.translate_errors).
    """
    import inspect

    from asyncpg import connect_utils

    parse: Any = getattr(connect_utils, "_parse_connect_dsn_and_args", None)
    try:
        signature = inspect.signature(parse)
        others = {name: None for name in signature.parameters if name != "dsn"}
        signature.bind(dsn=url, **others)
    except (TypeError, ValueError):  # no parser, or another signature: leave it to connect
        return None
    try:
        addresses = parse(dsn=url, **others)[0]
    except Exception as exc:  # whatever the parser raises, connect would raise too
        return f"not a PostgreSQL URL asyncpg can use (postgresql://user@host:port/db): {exc}"
    for address in addresses:
        if isinstance(address, tuple) and not 1 <= address[1] <= 65535:
            return f"port {address[1]} of host {address[0]} is not in 1..65535"
    return None


# The largest ``max_id_bytes`` PostgreSQL can carry. Namespace and task_id
# together form the primary key (a btree entry holds at most 2704 bytes), and
# every change notification (migration 0005) carries the namespace, task_id,
# owner_id and claim request id, and a revoke reason of up to 1024 bytes, as
# JSON within PostgreSQL's 8000-byte payload. JSON doubles a quote or a
# backslash (ids hold no control characters), so the worst payload is
# 2 * (4 * 640 + 1024) bytes plus about 450 of keys and values: 7,585 bytes
# measured (tests/integration/test_watch.py sends it).
MAX_ID_BYTES_LIMIT = 640


class Settings(BaseSettings):
    """The service's settings; each field maps to ``LEASEKEEPER_<FIELD>``.

    They are read from the environment and from a ``.env`` file in the working
    directory; a variable set in the environment wins over the file. Durations are
    in seconds (their names end in ``_s``), sizes in bytes. A setting that is out of
    its bounds or cannot be parsed stops ``serve``, ``migrate``, ``tokens`` and
    ``limits`` before they start: exit status 2, with one line naming the variable.
    """

    model_config = SettingsConfigDict(
        env_prefix="LEASEKEEPER_", env_file=".env", extra="ignore", frozen=True
    )

    database_url: str | None = Field(
        default=None,
        description="PostgreSQL URL (postgresql://user@host:port/db), PostgreSQL 13 or newer. "
        "Unset: an embedded PostgreSQL in data_dir. Checked at start by asyncpg's own URL "
        "parser (and ports 1..65535): a URL it cannot use exits 2 at once. Through a pooler: "
        "PgBouncer pool_mode=session, or pool_mode=transaction with database_pool_mode "
        "transaction; what the URL leads to is probed at start, and a pooler in statement "
        "mode, or in transaction mode while database_pool_mode is session, exits 2.",
    )
    database_pool_mode: Literal["session", "transaction"] = Field(
        default="session",
        description="What database_url's connections keep. session: each its own PostgreSQL "
        "session (PostgreSQL itself, PgBouncer pool_mode=session). transaction: a session per "
        "transaction (PgBouncer pool_mode=transaction): no prepared statement is kept, each "
        "statement runs in a transaction of its own that sets its timeouts (SET LOCAL), and "
        "notifications, migrations and the expiry sweeper's election use direct_database_url "
        "(required). Explicit rather than detected: the direct URL is needed anyway, and a "
        "pooler reconfigured later is refused at the next start instead of silently served "
        "differently.",
    )
    direct_database_url: str | None = Field(
        default=None,
        validate_default=True,
        description="PostgreSQL URL of a connection that keeps its session (PostgreSQL itself, "
        "never a transaction pooler) for the notification listener (LISTEN), the migrations' "
        "lock and the expiry sweeper's election (session advisory locks); the `migrate`, "
        "`tokens` and `limits` commands use it too. Unset: database_url. Required when "
        "database_pool_mode is transaction; checked at start like database_url.",
    )
    data_dir: Path = Field(
        default_factory=default_data_dir,
        description="Data directory of the embedded PostgreSQL; survives restarts; logged at "
        "start.",
    )
    listen: str = Field(default="127.0.0.1:9457", description="gRPC listen address host:port.")
    health_listen: str | None = Field(
        default=None,
        description=(
            "A second, plaintext port serving only the gRPC health service (host:port), "
            "for probes that cannot speak TLS, such as Kubernetes' gRPC probes; unset: "
            "health is served on the main port only."
        ),
    )
    metrics_listen: str | None = Field(
        default=None,
        description=(
            "Prometheus metrics over HTTP (GET /metrics) on host:port (port 0: any free "
            "port); unset: no metrics endpoint."
        ),
    )
    default_ttl_s: float = Field(
        default=30.0, gt=0, description="Lease ttl when a request sets none."
    )
    min_ttl_s: float = Field(default=1.0, gt=0, description="Shortest ttl a request may ask.")
    max_ttl_s: float = Field(default=3600.0, gt=0, description="Longest ttl a request may ask.")
    max_runtime_s: float = Field(
        default=86400.0,
        gt=0,
        description="Runtime budget of a lease when its claim sets none, and the most it may set.",
    )
    min_renew_interval_s: float = Field(
        default=0.5,
        ge=0,
        description="Heartbeat beats sooner than this (or ttl/3, if shorter) after the last "
        "renewal are answered without a database write.",
    )
    max_id_bytes: int = Field(
        default=256,
        ge=1,
        le=MAX_ID_BYTES_LIMIT,
        description="Longest namespace, task_id or owner_id, in bytes of UTF-8. At most 640: the "
        "primary key and PostgreSQL's 8000-byte change notifications carry them.",
    )
    max_effect_result_bytes: int = Field(
        default=65536,
        ge=0,
        le=1 << 20,
        description="Largest result CompleteEffect may record (bytes).",
    )
    max_checkpoint_bytes: int = Field(
        default=262144,
        ge=0,
        le=3 << 20,
        description=(
            "Largest checkpoint data a worker may save (bytes); a larger one is refused "
            "INVALID_ARGUMENT naming checkpoint.data. At most 3 MiB: a claim's answer carries "
            "the checkpoint, and gRPC clients refuse messages over 4 MiB."
        ),
    )
    history_max_age_s: float = Field(
        default=30 * 86400.0,
        gt=0,
        description="How long task history entries are kept (seconds); older ones are pruned "
        "in the background.",
    )
    history_max_per_task: int = Field(
        default=1000,
        ge=1,
        description="Most history entries kept per task; the oldest beyond it are pruned in "
        "the background.",
    )
    history_prune_interval_s: float = Field(
        default=60.0,
        gt=0,
        description="Time between two passes of the history pruner (seconds).",
    )
    pool_min_size: int = Field(default=2, ge=1, description="Database connections kept open.")
    pool_max_size: int = Field(default=20, ge=1, description="Most database connections.")
    statement_timeout_s: float = Field(
        default=5.0, gt=0, description="PostgreSQL's `statement_timeout` on every connection."
    )
    lock_timeout_s: float = Field(
        default=3.0, gt=0, description="PostgreSQL's `lock_timeout` on every connection."
    )
    batch_tick_s: float = Field(
        default=0.002,
        ge=0,
        description="While calls keep coming (busy), the least time between the starts of two "
        "batched statements of one kind (claims, renewals, reads); calls arriving meanwhile "
        "go together. A call in a quiet moment is sent at once.",
    )
    batch_lock_timeout_s: float = Field(
        default=0.05,
        gt=0,
        description="How long a batched statement (claims, renewals or reads arriving together, "
        "sent as one) may wait for a row lock; past it, its calls run one by one with "
        "lock_timeout_s, so one locked row never holds up the rest.",
    )
    connect_timeout_s: float = Field(
        default=3.0,
        gt=0,
        description="Time to open a database connection or take one from the pool.",
    )
    health_interval_s: float = Field(
        default=1.0,
        gt=0,
        description="How often the health service checks that calls can be decided: "
        "one ping taking the write path, and the calls' statements since the last check.",
    )
    keepalive_time_s: float = Field(
        default=10.0,
        ge=1,
        le=7200,
        description="A client connection the server has read nothing from for this long "
        "gets an HTTP/2 ping.",
    )
    keepalive_timeout_s: float = Field(
        default=5.0,
        ge=1,
        le=600,
        description="A ping unanswered this long, or data the client's kernel has not "
        "acknowledged this long (TCP_USER_TIMEOUT), closes the connection and ends its "
        "calls and streams (the leases of its heartbeats run out their ttl as usual): a dead "
        "or cut-off client is dropped within keepalive_time_s + keepalive_timeout_s. Shorter "
        "finds dead clients sooner; too short drops healthy clients on a slow or lossy link.",
    )
    max_claim_wait_s: float = Field(
        default=60.0,
        ge=0,
        description="Longest ClaimRequest.wait a claim may ask (it waits for its task).",
    )
    sweep_interval_s: float = Field(
        default=1.0,
        gt=0,
        description=(
            "How often the elected sweeper announces expired leases (Watch's EXPIRED "
            "events, the expiry metrics) and a non-leader tries to take over."
        ),
    )
    limits_refresh_s: float = Field(
        default=30.0,
        gt=0,
        description=("How often namespace limits are reloaded even without a change notification."),
    )
    shutdown_grace_s: float = Field(
        default=10.0, ge=0, description="How long unary calls may finish after SIGTERM/SIGINT."
    )
    startup_wait_s: float = Field(
        default=60.0,
        ge=0,
        description=(
            "How long `serve` keeps trying to reach the database at start (a database "
            "restarting, a failover settling; one log line per attempt, waits doubling from "
            "0.2 s to 5 s) before it exits with status 1. A database that refuses the "
            "connection (an unknown role, a wrong password, a missing database) is not "
            "retried: exit status 2 at once, with PostgreSQL's message."
        ),
    )
    workers: int = Field(
        default=1,
        ge=1,
        description=(
            "Server processes `serve` runs on the listen port (shared through SO_REUSEPORT) "
            "and one database, supervised by the `serve` process; worker k serves metrics on "
            "metrics_listen's port + k. 1: the `serve` process serves alone, and a taken "
            "port is an error. `serve --workers N` overrides it."
        ),
    )
    log_level: str = Field(default="INFO", description="Python logging level.")
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="Log lines as text, or JSON objects (time, level, logger, message and the "
        "task's fields); see leasekeeper_server.observability.logs.",
    )
    audit_log: Path | None = Field(
        default=None,
        description="File the audit log (JSON lines: grants, releases, losses, expiries, "
        "revokes, cancels and retries) is appended to; unset: standard error.",
    )
    otlp_endpoint: str | None = Field(
        default=None,
        description="OpenTelemetry collector (OTLP over gRPC, e.g. http://127.0.0.1:4317) to "
        "send a span per call and per SQL statement to; unset: no tracing.",
    )
    auth: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Bearer tokens on LeaseService calls: on, off, or auto (off when the listen "
        "address is loopback, 127.0.0.0/8, ::1 or localhost; on otherwise). Off on an address "
        "that is not loopback logs a warning at start.",
    )
    tokens_file: Path | None = Field(
        default=None,
        description="TOML file of hashed tokens (see leasekeeper_server.security.tokens), reloaded "
        "when it changes; tokens in the database (`leasekeeper tokens create`) are accepted too.",
    )
    tls_cert_file: Path | None = Field(
        default=None,
        description="PEM certificate chain for TLS on the gRPC port; reloaded when the file "
        "changes (new connections get the new certificate, without a restart).",
    )
    tls_key_file: Path | None = Field(
        default=None, description="PEM private key of tls_cert_file; reloaded when it changes."
    )
    tls_client_ca_file: Path | None = Field(
        default=None,
        description="PEM CA certificates for mutual TLS: set, clients must present a "
        "certificate they sign; reloaded.",
    )
    console_listen: str = Field(
        default="127.0.0.1:9460",
        description="The operator console (a web app in the browser) on host:port (port 0: "
        "any free port), served by `serve` beside the gRPC port and logged at start "
        "(`leasekeeper console on http://HOST:PORT/`); `off` or empty: no console. It calls "
        "this server's gRPC port on loopback with each viewer's token, so a server whose "
        "gRPC port uses TLS starts no console (run `leasekeeper console` instead). Off "
        "loopback it needs console_tls_cert_file and console_tls_key_file, or "
        "console_insecure: otherwise `serve` exits 2. When this default address is taken "
        "`serve` starts without a console (a warning); an address set explicitly that is "
        "taken stops the start (exit 1). With `serve --workers N` the supervising process "
        "serves the one console, calling the shared port.",
    )
    console_tls_cert_file: Path | None = Field(
        default=None,
        description="PEM certificate chain for HTTPS on the console's port (read at start); "
        "the console's session cookie is then marked Secure.",
    )
    console_tls_key_file: Path | None = Field(
        default=None, description="PEM private key of console_tls_cert_file (read at start)."
    )
    console_insecure: bool = Field(
        default=False,
        description="Allow the console over plain HTTP on an address that is not loopback "
        "(logged as a warning at start): sign-in tokens and session cookies then travel in "
        "clear text. Only behind a proxy that adds TLS, or on a trusted network.",
    )

    @field_validator("listen", "health_listen", "metrics_listen")
    @classmethod
    def _check_address(cls, value: str | None) -> str | None:
        """A listen address is host:port with a port in 0..65535 (0: any free port)."""
        if value is None:
            return value
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"{value!r} is not host:port with a port in 0..65535")
        return value

    @field_validator("console_listen")
    @classmethod
    def _check_console_listen(cls, value: str) -> str:
        """``off`` or empty (no console), else host:port as the other listen addresses."""
        if value.strip().lower() in ("", "off"):
            return "off"
        checked = cls._check_address(value)
        assert checked is not None
        return checked

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str | None) -> str | None:
        """A URL asyncpg can connect with (database_url_problem); empty: unset."""
        problem = database_url_problem(value) if value else None
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("database_pool_mode")
    @classmethod
    def _check_pool_mode(cls, value: str, info: ValidationInfo) -> str:
        """Transaction mode names a pooler: it needs database_url (not the embedded PostgreSQL)."""
        if value == "transaction" and "database_url" in info.data and not info.data["database_url"]:
            raise ValueError(
                "transaction needs LEASEKEEPER_DATABASE_URL (the pooler's URL); "
                "the embedded PostgreSQL is reached directly"
            )
        return value

    @field_validator("direct_database_url")
    @classmethod
    def _check_direct_database_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A URL asyncpg can use, beside database_url; required in transaction mode."""
        if not value:
            if info.data.get("database_pool_mode") == "transaction":
                raise ValueError(
                    "required when LEASEKEEPER_DATABASE_POOL_MODE=transaction: the notification "
                    "listener (LISTEN), the migrations' lock and the expiry sweeper's election "
                    "need a connection to PostgreSQL itself that keeps its session"
                )
            return None
        if "database_url" in info.data and not info.data["database_url"]:
            raise ValueError("needs LEASEKEEPER_DATABASE_URL: the embedded PostgreSQL is direct")
        problem = database_url_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _check_bounds(self) -> Settings:
        if not self.min_ttl_s <= self.default_ttl_s <= self.max_ttl_s:
            raise ValueError("need min_ttl_s <= default_ttl_s <= max_ttl_s")
        if self.max_runtime_s < self.min_ttl_s:
            raise ValueError("need min_ttl_s <= max_runtime_s")
        if self.pool_min_size > self.pool_max_size:
            raise ValueError("need pool_min_size <= pool_max_size")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("need both tls_cert_file and tls_key_file, or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        if (self.console_tls_cert_file is None) != (self.console_tls_key_file is None):
            raise ValueError("need both console_tls_cert_file and console_tls_key_file, or neither")
        return self
