"""Bearer tokens, roles and namespaces, on a real server with real tokens.

Tokens come from the database (``leasekeeper_server.security.tokens.create_token``) and
from a token file; every call goes over a real gRPC channel.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from leasekeeper import LeaseClient, LeaseError
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from leasekeeper_server import security as auth
from leasekeeper_server.app import LeaseServer
from leasekeeper_server.core.errors import PermissionDenied
from leasekeeper_server.rpc.handling import abort_with
from leasekeeper_server.security import tokens
from tests.conftest import RunningServer, make_settings, running_server
from tests.helpers import dur, error_info, poll
from tests.integration.contract_helpers import failure, heartbeat_on, snapshot

pytestmark = pytest.mark.timeout(60)

Metadata = tuple[tuple[str, str], ...] | None
SERVICE = pb.DESCRIPTOR.services_by_name["LeaseService"]


def bearer(token: str) -> Metadata:
    return (("authorization", f"Bearer {token}"),)


async def make_token(db: asyncpg.Connection, role: str, *namespaces: str, **kw: Any) -> str:
    _record, token = await tokens.create_token(db, f"{role}-test", role, namespaces, **kw)
    return token


def request_for(method: str, namespace: str, fence: int = 1) -> Any:
    """A well-formed request for every LeaseService RPC, on task "t" owned by "w"."""
    lease = {"namespace": namespace, "task_id": "t"}
    owned = {**lease, "owner_id": "w", "fence": fence}
    return {
        "Claim": lambda: pb.ClaimRequest(**lease, owner_id="w", ttl=dur(5)),
        "Renew": lambda: pb.RenewRequest(**owned),
        "Release": lambda: pb.ReleaseRequest(**owned),
        "ValidateFence": lambda: pb.ValidateFenceRequest(**lease, fence=fence),
        "GetLease": lambda: pb.GetLeaseRequest(**lease),
        "ListLeases": lambda: pb.ListLeasesRequest(namespace=namespace),
        "ListNamespaces": lambda: pb.ListNamespacesRequest(),
        "GetNamespaceStats": lambda: pb.GetNamespaceStatsRequest(namespace=namespace),
        "BeginEffect": lambda: pb.BeginEffectRequest(
            **lease, fence=fence, effect_key="e", policy=pb.EFFECT_POLICY_ONCE
        ),
        "CompleteEffect": lambda: pb.CompleteEffectRequest(
            **lease, fence=fence, effect_key="e", outcome=pb.EFFECT_STATE_SUCCEEDED
        ),
        "ListEffects": lambda: pb.ListEffectsRequest(**lease),
        "Revoke": lambda: pb.RevokeRequest(**lease, reason="test"),
        "Watch": lambda: pb.WatchRequest(**lease),
        "Heartbeat": lambda: pb.HeartbeatRequest(**owned),
        "SaveCheckpoint": lambda: pb.SaveCheckpointRequest(
            **owned, checkpoint=pb.Checkpoint(version=1, data=b"x")
        ),
        "Cancel": lambda: pb.CancelRequest(**lease, reason="test"),
        "Retry": lambda: pb.RetryRequest(**lease, reason="test"),
        "ListTaskHistory": lambda: pb.ListTaskHistoryRequest(**lease),
        "Session": lambda: pb.SessionRequest(
            sequence=1, add=[pb.SessionRequest.Add(id=1, **owned)], beat=True
        ),
        "ValidateFences": lambda: pb.ValidateFencesRequest(
            checks=[
                pb.ValidateFencesRequest.Check(
                    id=1, request=pb.ValidateFenceRequest(**lease, fence=fence)
                )
            ]
        ),
    }[method]()


async def invoke(
    stub: rpc.LeaseServiceStub, method: str, namespace: str, metadata: Metadata, fence: int = 1
) -> Any:
    """Calls ``method``; for the streams, returns their first response."""
    request = request_for(method, namespace, fence)
    if method in ("Heartbeat", "ValidateFences", "Session"):
        call = getattr(stub, method)(metadata=metadata)
        await call.write(request)
        try:
            return await asyncio.wait_for(call.read(), 5)
        finally:
            call.cancel()
    if method == "Watch":
        stream = stub.Watch(request, metadata=metadata)
        try:
            return await asyncio.wait_for(stream.read(), 5)
        finally:
            stream.cancel()
    return await getattr(stub, method)(request, metadata=metadata, timeout=10)


async def refused(call: Awaitable[Any], code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    error = await failure(call)
    assert error.code() == code, (error.code(), error.details())
    assert error_info(error).reason == code.name
    return error


async def is_refused(stub: rpc.LeaseServiceStub, namespace: str, token: str) -> bool:
    try:
        await invoke(stub, "GetLease", namespace, bearer(token))
    except grpc.aio.AioRpcError as error:
        return error.code() is grpc.StatusCode.UNAUTHENTICATED
    return False


async def is_accepted(stub: rpc.LeaseServiceStub, namespace: str, token: str) -> bool:
    try:
        await invoke(stub, "ListEffects", namespace, bearer(token))
    except grpc.aio.AioRpcError as error:
        assert error.code() is grpc.StatusCode.UNAUTHENTICATED, error
        return False
    return True


@pytest.fixture
async def secured(database_url: str) -> AsyncIterator[RunningServer]:
    """A server on loopback with auth=on: tokens are enforced even there."""
    async with running_server(database_url, auth="on") as running:
        yield running


@pytest.fixture
async def stub(secured: RunningServer) -> AsyncIterator[rpc.LeaseServiceStub]:
    async with grpc.aio.insecure_channel(secured.target) as channel:
        yield rpc.LeaseServiceStub(channel)


@pytest.fixture
async def admin(db: asyncpg.Connection) -> str:
    return await make_token(db, "admin", "*")


async def claimed(stub: rpc.LeaseServiceStub, namespace: str, admin: str) -> int:
    reply = await invoke(stub, "Claim", namespace, bearer(admin))
    assert reply.acquired
    return int(reply.lease.fence)


def test_request_table_covers_every_rpc() -> None:
    names = {m.name for m in SERVICE.methods}
    for name in names - auth.UNSCOPED_METHODS:
        request = request_for(name, "n")
        if name == "ValidateFences":  # each check names its own namespace
            request = request.checks[0].request
        if name == "Session":  # each lease added names its own namespace
            request = request.add[0]
        assert request.namespace == "n"
    for name in auth.UNSCOPED_METHODS:  # no namespace: the answer leaves out what is not covered
        assert "namespace" not in request_for(name, "n").DESCRIPTOR.fields_by_name
    assert set().union(*auth.ROLE_METHODS.values()) | auth.UNSCOPED_METHODS <= names


@pytest.mark.parametrize("method", [m.name for m in SERVICE.methods])
async def test_call_without_token_is_unauthenticated_and_changes_nothing(
    stub: rpc.LeaseServiceStub, db: asyncpg.Connection, namespace: str, admin: str, method: str
) -> None:
    fence = await claimed(stub, namespace, admin)
    before = await snapshot(db, namespace)
    error = await refused(
        invoke(stub, method, namespace, None, fence), grpc.StatusCode.UNAUTHENTICATED
    )
    assert "Bearer" in (error.details() or "")
    assert await snapshot(db, namespace) == before


@pytest.mark.parametrize(
    "header",
    [
        "Bearer lk_AAAAAAAAAA_" + "x" * 43,  # the right shape, never issued
        "Bearer not-a-token",
        "Basic dXNlcjpwYXNz",  # another scheme
        "Bearer ",
    ],
)
async def test_call_with_unknown_token_is_unauthenticated(
    stub: rpc.LeaseServiceStub, db: asyncpg.Connection, namespace: str, admin: str, header: str
) -> None:
    await claimed(stub, namespace, admin)
    before = await snapshot(db, namespace)
    for method in ("Claim", "Release", "Revoke"):
        await refused(
            invoke(stub, method, namespace, (("authorization", header),)),
            grpc.StatusCode.UNAUTHENTICATED,
        )
    assert await snapshot(db, namespace) == before


async def test_worker_token_in_another_namespace_is_denied_and_task_unchanged(
    stub: rpc.LeaseServiceStub, db: asyncpg.Connection, namespace: str, admin: str
) -> None:
    other = f"{namespace}-other"
    worker = await make_token(db, "worker", namespace)
    fence = await claimed(stub, other, admin)
    before = await snapshot(db, other)
    for method in ("Claim", "Renew", "Release", "GetLease", "BeginEffect", "Watch", "Heartbeat"):
        error = await refused(
            invoke(stub, method, other, bearer(worker), fence), grpc.StatusCode.PERMISSION_DENIED
        )
        assert other in (error.details() or ""), method
    assert await snapshot(db, other) == before
    # In its own namespace the same token works.
    assert (await invoke(stub, "Claim", namespace, bearer(worker))).acquired


@pytest.mark.parametrize(
    ("role", "method", "allowed"),
    [
        ("effect", "Claim", False),
        ("effect", "Renew", False),
        ("effect", "Release", False),
        ("effect", "Heartbeat", False),
        ("effect", "Session", False),
        ("worker", "Session", True),
        ("effect", "ValidateFence", True),
        ("effect", "ValidateFences", True),
        ("worker", "ValidateFences", False),
        ("admin", "ValidateFences", True),
        ("effect", "GetLease", True),
        ("effect", "BeginEffect", True),
        ("effect", "ListEffects", True),
        ("worker", "ListLeases", False),
        ("worker", "Revoke", False),
        ("worker", "ValidateFence", False),
        ("worker", "GetLease", True),
        ("worker", "Renew", True),
        ("worker", "Watch", True),
        ("worker", "Heartbeat", True),
        ("effect", "Watch", False),
        ("admin", "ListLeases", True),
        ("worker", "ListNamespaces", False),
        ("effect", "ListNamespaces", False),
        ("admin", "ListNamespaces", True),
        ("worker", "GetNamespaceStats", False),
        ("effect", "GetNamespaceStats", False),
        ("admin", "GetNamespaceStats", True),
        ("admin", "ValidateFence", True),
        ("admin", "Revoke", True),
    ],
)
async def test_role_decides_which_rpcs_a_token_may_call(
    stub: rpc.LeaseServiceStub,
    db: asyncpg.Connection,
    namespace: str,
    admin: str,
    role: str,
    method: str,
    allowed: bool,
) -> None:
    fence = await claimed(stub, namespace, admin)
    token = await make_token(db, role, namespace)
    before = await snapshot(db, namespace)
    if allowed:
        await invoke(stub, method, namespace, bearer(token), fence)
        return
    error = await refused(
        invoke(stub, method, namespace, bearer(token), fence), grpc.StatusCode.PERMISSION_DENIED
    )
    assert method in (error.details() or "")
    assert await snapshot(db, namespace) == before


async def test_effect_token_validates_fence_and_admin_lists_leases(
    stub: rpc.LeaseServiceStub, db: asyncpg.Connection, namespace: str, admin: str
) -> None:
    fence = await claimed(stub, namespace, admin)
    effect = await make_token(db, "effect", namespace)
    answer = await invoke(stub, "ValidateFence", namespace, bearer(effect), fence)
    assert answer.valid and answer.current_fence == fence
    listed = await invoke(stub, "ListLeases", namespace, bearer(admin))
    assert [lease.task_id for lease in listed.leases] == ["t"]


@pytest.mark.parametrize(
    ("patterns", "suffix", "allowed"),
    [
        (("*",), "/anything", True),
        (("{ns}/*",), "/team-a", True),
        (("{ns}/*",), "", False),  # the prefix is "{ns}/": {ns} itself is not under it
        (("{ns}/*",), "-x/team-a", False),
        (("{ns}*",), "-x", True),
        (("{ns}/a",), "/a", True),
        (("{ns}/a",), "/ab", False),
        (("{ns}/a", "{ns}/b/*"), "/b/c", True),
    ],
)
async def test_namespace_patterns_cover_exact_prefix_and_all(
    stub: rpc.LeaseServiceStub,
    db: asyncpg.Connection,
    namespace: str,
    patterns: tuple[str, ...],
    suffix: str,
    allowed: bool,
) -> None:
    token = await make_token(db, "worker", *(p.format(ns=namespace) for p in patterns))
    target = namespace + suffix
    if allowed:
        assert (await invoke(stub, "Claim", target, bearer(token))).acquired
    else:
        await refused(
            invoke(stub, "Claim", target, bearer(token)), grpc.StatusCode.PERMISSION_DENIED
        )
        count = "SELECT count(*) FROM leasekeeper_tasks WHERE namespace = $1"
        assert await db.fetchval(count, target) == 0


async def test_revoked_database_token_is_refused_within_a_bounded_poll(
    stub: rpc.LeaseServiceStub, db: asyncpg.Connection, namespace: str
) -> None:
    record, token = await tokens.create_token(db, "soon-revoked", "worker", [namespace])
    assert await is_accepted(stub, namespace, token)  # now cached as valid
    assert await tokens.revoke_token(db, record.token_id)
    assert not await tokens.revoke_token(db, record.token_id)  # already revoked
    await poll(lambda: is_refused(stub, namespace, token), "the revoked token refused")
    listed = {r.token_id: r for r in await tokens.list_tokens(db)}
    assert listed[record.token_id].revoke_time is not None


async def test_expired_database_token_is_refused(
    stub: rpc.LeaseServiceStub, db: asyncpg.Connection, namespace: str
) -> None:
    past = datetime.now(UTC) - timedelta(hours=1)
    expired = await make_token(db, "worker", namespace, expire_time=past)
    await refused(
        invoke(stub, "GetLease", namespace, bearer(expired)), grpc.StatusCode.UNAUTHENTICATED
    )
    future = datetime.now(UTC) + timedelta(hours=1)
    live = await make_token(db, "worker", namespace, expire_time=future)
    assert await is_accepted(stub, namespace, live)


async def test_token_created_after_a_refusal_is_accepted_at_once(
    stub: rpc.LeaseServiceStub, db: asyncpg.Connection, namespace: str
) -> None:
    # A refusal is cached too; the change notification must clear it.
    token_id, token = tokens.new_token()
    assert not await is_accepted(stub, namespace, token)
    await db.execute(
        "INSERT INTO leasekeeper_tokens (token_id, token_sha256, name, role, namespaces)"
        " VALUES ($1, $2, 'late', 'worker', $3)",
        token_id,
        tokens.digest(token),
        [namespace],
    )
    await poll(lambda: is_accepted(stub, namespace, token), "the new token accepted")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"role": "root"}, "role"),
        ({"namespaces": []}, "namespaces"),
        ({"namespaces": "billing"}, "namespaces"),
        ({"namespaces": ["a*b"]}, "namespaces"),
        ({"namespaces": [""]}, "namespaces"),
        ({"name": ""}, "name"),
        ({"expire_time": datetime(2030, 1, 1)}, "expire_time"),  # naive on purpose
    ],
)
async def test_create_token_with_bad_argument_names_the_field(
    db: asyncpg.Connection, kwargs: dict[str, Any], field: str
) -> None:
    args: dict[str, Any] = {"name": "n", "role": "worker", "namespaces": ["ns"], **kwargs}
    count = await db.fetchval("SELECT count(*) FROM leasekeeper_tokens")
    with pytest.raises(ValueError, match=f"^{field}:"):
        await tokens.create_token(db, **args)
    assert await db.fetchval("SELECT count(*) FROM leasekeeper_tokens") == count


async def test_created_token_has_documented_shape_and_only_its_digest_is_stored(
    db: asyncpg.Connection,
) -> None:
    record, token = await tokens.create_token(db, "shape", "effect", ["a", "b/*"])
    assert token.startswith(f"lk_{record.token_id}_")
    assert 8 <= len(record.token_id) <= 12
    assert tokens.token_id_of(token) == record.token_id
    stored = await db.fetchrow(
        "SELECT * FROM leasekeeper_tokens WHERE token_id = $1", record.token_id
    )
    assert stored["token_sha256"] == tokens.digest(token)
    assert token not in repr(dict(stored))
    assert record.namespaces == ("a", "b/*") and record.role == "effect"
    assert record.revoke_time is None and record.expire_time is None


def write_token_file(path: Path, entries: list[tuple[str, str, str, list[str]]]) -> None:
    text = "\n".join(tokens.file_entry(token, name, role, ns) for token, name, role, ns in entries)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # atomic, as a rotation should be


async def test_token_file_rotation_takes_effect_without_restart(
    database_url: str, tmp_path: Path, namespace: str
) -> None:
    old, new = tokens.new_token()[1], "any text works as a file token " + tokens.new_token()[1]
    path = tmp_path / "tokens.toml"
    write_token_file(path, [(old, "old", "worker", [namespace])])
    async with (
        running_server(database_url, auth="on", tokens_file=path) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        assert await is_accepted(stub, namespace, old)
        assert not await is_accepted(stub, namespace, new)
        write_token_file(path, [(new, "new", "worker", [namespace])])
        await poll(lambda: is_accepted(stub, namespace, new), "the new file token accepted")
        assert await is_refused(stub, namespace, old)


async def test_malformed_token_file_at_reload_keeps_previous_tokens(
    database_url: str, tmp_path: Path, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    token = tokens.new_token()[1]
    path = tmp_path / "tokens.toml"
    write_token_file(path, [(token, "kept", "worker", [namespace])])
    async with (
        running_server(database_url, auth="on", tokens_file=path) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        assert await is_accepted(stub, namespace, token)
        caplog.set_level(logging.ERROR, logger="leasekeeper_server.auth")
        path.write_text('[[token]]\nname = "broken"\nrole = "worker"\n')

        async def error_logged() -> bool:
            await is_accepted(stub, namespace, token)  # the reload happens on the call path
            return any("sha256: missing" in r.getMessage() for r in caplog.records)

        await poll(error_logged, "the malformed file reported")
        assert await is_accepted(stub, namespace, token)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[[token]\n", "not valid TOML"),
        ('[[token]]\nname = "x"\nsha256 = "00"\nrole = "worker"\nnamespaces = ["a"]\n', "sha256"),
        (
            f'[[token]]\nname = "x"\nsha256 = "{"0" * 64}"\nrole = "boss"\nnamespaces = ["a"]\n',
            "role",
        ),
    ],
)
async def test_malformed_token_file_at_start_fails_the_start(
    database_url: str, tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    server = LeaseServer(make_settings(database_url, auth="on", tokens_file=path), database_url)
    with pytest.raises(ValueError, match=message) as caught:
        await server.start()
    assert str(path) in str(caught.value)


async def test_token_file_entry_from_the_module_command_is_accepted(
    database_url: str, tmp_path: Path, namespace: str
) -> None:
    command = [sys.executable, "-m", "leasekeeper_server.cli.tokens"]
    options = ["--name", "cli", "--role", "admin", "--namespace", namespace]
    made = await asyncio.to_thread(
        subprocess.run,
        [*command, "new", *options],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    # stderr holds the token's one line and nothing else (no import warning beside it).
    assert made.stderr.startswith("token (shown once") and made.stderr.count("\n") == 1, made.stderr
    token = made.stderr.strip().rsplit(" ", 1)[-1]
    assert token not in made.stdout
    hashed = await asyncio.to_thread(
        subprocess.run,
        [*command, "hash", *options],
        input=token,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert hashed.stdout == made.stdout
    path = tmp_path / "tokens.toml"
    path.write_text(made.stdout)
    async with (
        running_server(database_url, auth="on", tokens_file=path) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub = rpc.LeaseServiceStub(channel)
        listed = await invoke(stub, "ListLeases", namespace, bearer(token))
        assert list(listed.leases) == []


async def test_health_check_needs_no_token(secured: RunningServer) -> None:
    async with grpc.aio.insecure_channel(secured.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE.full_name))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_malformed_body_with_valid_token_is_invalid_argument(
    stub: rpc.LeaseServiceStub, secured: RunningServer, db: asyncpg.Connection, namespace: str
) -> None:
    worker = await make_token(db, "worker", namespace)
    async with grpc.aio.insecure_channel(secured.target) as channel:
        claim = channel.unary_unary(f"/{SERVICE.full_name}/Claim")
        error = await failure(claim(b"\xff\xff\xff", metadata=bearer(worker)))
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
        # Without a token, the token is checked first.
        error = await failure(claim(b"\xff\xff\xff"))
        assert error.code() is grpc.StatusCode.UNAUTHENTICATED


async def test_auth_auto_is_off_on_loopback(server: RunningServer, namespace: str) -> None:
    assert server.server.settings.auth == "auto"
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = rpc.LeaseServiceStub(channel)
        assert (await invoke(stub, "Claim", namespace, None)).acquired


@pytest.mark.parametrize(
    ("listen", "auth_setting", "enabled"),
    [
        ("127.0.0.1:1", "auto", False),
        ("127.1.2.3:1", "auto", False),
        ("[::1]:1", "auto", False),
        ("localhost:1", "auto", False),
        ("0.0.0.0:1", "auto", True),
        ("[::]:1", "auto", True),
        ("10.0.0.5:1", "auto", True),
        ("leasekeeper.internal:1", "auto", True),
        ("127.0.0.1:1", "on", True),
        ("0.0.0.0:1", "off", False),
    ],
)
def test_auth_setting_resolves_by_listen_address(
    listen: str, auth_setting: str, enabled: bool
) -> None:
    settings = make_settings("postgresql://unused", listen=listen, auth=auth_setting)
    assert auth.auth_enabled(settings) is enabled


async def test_auth_off_on_all_interfaces_logs_a_warning(
    database_url: str, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="leasekeeper_server.auth")
    async with running_server(database_url, listen="0.0.0.0:0", auth="off") as server:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = rpc.LeaseServiceStub(channel)
            assert (await invoke(stub, "Claim", namespace, None)).acquired
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("anyone who can reach the port can take and revoke leases" in m for m in warnings)


async def test_auth_on_all_interfaces_without_tls_warns_of_clear_text(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="leasekeeper_server.auth")
    async with running_server(database_url, listen="0.0.0.0:0"):
        pass
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("tokens travel in clear text" in m for m in warnings), warnings


async def test_client_sends_its_token_on_calls_and_heartbeat(
    secured: RunningServer, db: asyncpg.Connection, namespace: str
) -> None:
    worker = await make_token(db, "worker", namespace)
    async with LeaseClient(secured.target, namespace, token=worker) as client:
        async with client.hold("t", ttl=0.6) as lease:
            first = lease.fence

            async def renewed() -> bool:
                row = await db.fetchrow(
                    "SELECT expire_time, claim_time FROM leasekeeper_tasks"
                    " WHERE namespace = $1 AND task_id = 't'",
                    namespace,
                )
                # Renewed by the heartbeat at least twice over the first ttl.
                return bool(row["expire_time"] - row["claim_time"] > timedelta(seconds=1.2))

            await poll(renewed, "the heartbeat renewed the lease")
        info = await client.get_lease("t")
        assert info.fence == first
    async with LeaseClient(secured.target, namespace, token="") as anonymous:
        with pytest.raises(LeaseError) as caught:
            await anonymous.claim("t2")
        assert caught.value.code is grpc.StatusCode.UNAUTHENTICATED


async def test_client_reads_token_from_environment(
    secured: RunningServer,
    db: asyncpg.Connection,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LEASEKEEPER_TOKEN", await make_token(db, "worker", namespace))
    async with LeaseClient(secured.target, namespace) as client:
        assert (await client.claim("t")).acquired


# The principal set by the interceptor must reach a stream handler that only
# learns its namespace from the first message (Heartbeat). Checked on a bare
# grpc.aio server whose LeaseService handler reports what it sees.


async def _echo_principal(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    async for namespace in requests:
        try:
            auth.authorize_namespace(namespace.decode())
        except PermissionDenied as exc:
            await abort_with(context, exc)
        principal = auth.current_principal()
        assert principal is not None
        yield principal.name.encode()


@pytest.fixture
async def bare(tmp_path: Path) -> AsyncIterator[tuple[grpc.aio.Channel, str]]:
    token = tokens.new_token()[1]
    path = tmp_path / "tokens.toml"
    write_token_file(path, [(token, "bare-worker", "worker", ["mine"])])

    def no_database() -> Any:
        raise AssertionError("file tokens need no database")

    authenticator = auth.Authenticator(no_database, auth.TokenFile(path))
    server = grpc.aio.server(interceptors=[auth.AuthInterceptor(authenticator)])
    handler = grpc.stream_stream_rpc_method_handler(_echo_principal)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, {"Heartbeat": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel, token
    finally:
        await server.stop(0)


async def test_principal_reaches_the_stream_handler(bare: tuple[grpc.aio.Channel, str]) -> None:
    channel, token = bare
    heartbeat = channel.stream_stream(f"/{SERVICE.full_name}/Heartbeat")
    call = heartbeat(metadata=bearer(token))
    await call.write(b"mine")
    assert await call.read() == b"bare-worker"
    await call.write(b"theirs")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "theirs" in (caught.value.details() or "")


async def test_authorize_namespace_allows_everything_without_a_principal() -> None:
    assert auth.current_principal() is None
    auth.authorize_namespace("any")


async def test_revoking_a_token_ends_its_open_streams_and_waiting_claims(
    stub: rpc.LeaseServiceStub, db: asyncpg.Connection, namespace: str
) -> None:
    record, token = await tokens.create_token(db, "streaming", "worker", [namespace])
    other = await make_token(db, "worker", namespace)
    metadata = bearer(token)
    granted = await stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="a", ttl=dur(30)),
        metadata=metadata,
    )
    await stub.Claim(
        pb.ClaimRequest(namespace=namespace, task_id="held", owner_id="z", ttl=dur(30)),
        metadata=bearer(other),
    )
    heartbeat, _ = await heartbeat_on(stub, granted.lease, metadata)
    watch = stub.Watch(pb.WatchRequest(namespace=namespace, task_id="t"), metadata=metadata)
    assert (await watch.read()).type == pb.TASK_EVENT_TYPE_SNAPSHOT
    waiting = asyncio.ensure_future(
        stub.Claim(
            pb.ClaimRequest(namespace=namespace, task_id="held", owner_id="b", wait=dur(20)),
            metadata=metadata,
        )
    )

    assert await tokens.revoke_token(db, record.token_id)

    # Each long call ends UNAUTHENTICATED once the revoke is announced (well
    # within the 5 s bound here), without another message from the client.
    for call in (heartbeat.read(), watch.read(), waiting):
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(call, 5.0)
        assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_effect_token_cannot_write_a_checkpoint_through_complete_effect(stub, db, namespace):
    """next_checkpoint writes what SaveCheckpoint writes: the effect role may not send it."""
    worker = bearer(await make_token(db, "worker", namespace))
    effect = bearer(await make_token(db, "effect", namespace))
    claim = pb.ClaimRequest(namespace=namespace, task_id="t", owner_id="w", ttl=dur(30))
    lease = (await stub.Claim(claim, metadata=worker)).lease
    begin = pb.BeginEffectRequest(
        namespace=namespace, task_id="t", fence=lease.fence, effect_key="e",
        policy=pb.EFFECT_POLICY_ONCE,
    )  # fmt: skip
    await stub.BeginEffect(begin, metadata=effect)
    complete = pb.CompleteEffectRequest(
        namespace=namespace, task_id="t", fence=lease.fence, effect_key="e",
        outcome=pb.EFFECT_STATE_SUCCEEDED,
        next_checkpoint=pb.Checkpoint(version=10**12, data=b"x"),
    )  # fmt: skip
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.CompleteEffect(complete, metadata=effect)
    assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
    got = await stub.GetLease(pb.GetLeaseRequest(namespace=namespace, task_id="t"), metadata=worker)
    assert got.lease.checkpoint_version == 0  # nothing stored, the outcome neither
    complete.ClearField("next_checkpoint")
    done = await stub.CompleteEffect(complete, metadata=effect)  # without it: its own call
    assert done.effect.state == pb.EFFECT_STATE_SUCCEEDED
