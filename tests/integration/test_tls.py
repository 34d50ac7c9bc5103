"""TLS and mutual TLS on the gRPC port, with certificates made in the test.

Handshakes are real (a real server, real channels); rotation rewrites the
files under a running server and checks what new connections see.
"""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import grpc
import pydantic
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from leasekeeper import LeaseClient
from leasekeeper.v1 import lease_service_pb2 as pb
from leasekeeper.v1 import lease_service_pb2_grpc as rpc
from leasekeeper_server.app import LeaseServer
from leasekeeper_server.security import tokens
from tests.conftest import RunningServer, make_settings, running_server
from tests.helpers import poll

pytestmark = pytest.mark.timeout(60)

POLL_S = 5.0
# A fresh connection per channel: grpc may otherwise share one between channels.
CHANNEL_OPTIONS = (("grpc.use_local_subchannel_pool", 1),)


@dataclass
class Authority:
    """A test CA that issues certificates."""

    name: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate

    @classmethod
    def make(cls, name: str) -> Authority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.now(UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(hours=1))
            .not_valid_after(now + timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        return cls(name, key, cert)

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, common_name: str, *, server: bool) -> tuple[bytes, bytes]:
        """A (key PEM, certificate PEM) pair for a server (127.0.0.1, localhost) or a client."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(hours=1))
            .not_valid_after(now + timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if server:
            names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return key_pem, cert.public_bytes(serialization.Encoding.PEM)


@dataclass
class ServerFiles:
    cert: Path
    key: Path
    client_ca: Path

    def install(self, authority: Authority) -> None:
        """Writes a new server certificate from ``authority``, each file replaced atomically."""
        key_pem, cert_pem = authority.issue("leasekeeper", server=True)
        replace(self.key, key_pem)
        replace(self.cert, cert_pem)


def replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


@pytest.fixture
def server_ca() -> Authority:
    return Authority.make("server-ca")


@pytest.fixture
def client_ca() -> Authority:
    return Authority.make("client-ca")


@pytest.fixture
def files(tmp_path: Path, server_ca: Authority, client_ca: Authority) -> ServerFiles:
    files = ServerFiles(tmp_path / "server.pem", tmp_path / "server.key", tmp_path / "clients.pem")
    files.install(server_ca)
    files.client_ca.write_bytes(client_ca.pem)
    return files


@pytest.fixture
async def tls_server(database_url: str, files: ServerFiles) -> AsyncIterator[RunningServer]:
    async with running_server(
        database_url, tls_cert_file=files.cert, tls_key_file=files.key
    ) as running:
        yield running


@pytest.fixture
async def mtls_server(database_url: str, files: ServerFiles) -> AsyncIterator[RunningServer]:
    async with running_server(
        database_url,
        tls_cert_file=files.cert,
        tls_key_file=files.key,
        tls_client_ca_file=files.client_ca,
    ) as running:
        yield running


async def health_over(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    """The code of a health check over a new connection (OK when it answers SERVING)."""
    if credentials is None:
        channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
    else:
        channel = grpc.aio.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
    async with channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        except grpc.aio.AioRpcError as error:
            return error.code()
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return grpc.StatusCode.OK


def trusting(
    authority: Authority, client: tuple[bytes, bytes] | None = None
) -> grpc.ChannelCredentials:
    if client is None:
        return grpc.ssl_channel_credentials(root_certificates=authority.pem)
    key_pem, cert_pem = client
    return grpc.ssl_channel_credentials(authority.pem, key_pem, cert_pem)


async def poll_until_ok(target: str, credentials: grpc.ChannelCredentials) -> None:
    async def served() -> bool:
        return await health_over(target, credentials) is grpc.StatusCode.OK

    await poll(served, "the new certificate served", within_s=POLL_S)


async def test_tls_client_trusting_the_ca_connects(
    tls_server: RunningServer, server_ca: Authority, namespace: str
) -> None:
    assert await health_over(tls_server.target, trusting(server_ca)) is grpc.StatusCode.OK
    async with LeaseClient(tls_server.target, namespace, credentials=trusting(server_ca)) as client:
        assert (await client.claim("t")).acquired


async def test_tls_refuses_plaintext_and_untrusting_clients(
    tls_server: RunningServer, client_ca: Authority
) -> None:
    assert await health_over(tls_server.target, None) is grpc.StatusCode.UNAVAILABLE
    other = trusting(client_ca)  # a CA that did not sign the server's certificate
    assert await health_over(tls_server.target, other) is grpc.StatusCode.UNAVAILABLE


async def test_mtls_requires_a_client_certificate_from_the_client_ca(
    mtls_server: RunningServer, server_ca: Authority, client_ca: Authority
) -> None:
    target = mtls_server.target
    assert await health_over(target, trusting(server_ca)) is grpc.StatusCode.UNAVAILABLE
    stranger = Authority.make("stranger").issue("intruder", server=False)
    assert await health_over(target, trusting(server_ca, stranger)) is grpc.StatusCode.UNAVAILABLE
    worker = client_ca.issue("worker-1", server=False)
    assert await health_over(target, trusting(server_ca, worker)) is grpc.StatusCode.OK


async def test_certificate_rotation_reaches_new_connections_without_restart(
    tls_server: RunningServer, files: ServerFiles, server_ca: Authority
) -> None:
    target = tls_server.target
    assert await health_over(target, trusting(server_ca)) is grpc.StatusCode.OK
    successor = Authority.make("server-ca-2")
    files.install(successor)
    await poll_until_ok(target, trusting(successor))
    assert await health_over(target, trusting(server_ca)) is grpc.StatusCode.UNAVAILABLE
    assert tls_server.server.certificates is not None
    assert tls_server.server.certificates.reloads == 1


async def test_half_written_rotation_keeps_serving_the_last_good_pair(
    tls_server: RunningServer, files: ServerFiles, server_ca: Authority
) -> None:
    target = tls_server.target
    successor = Authority.make("server-ca-2")
    key_pem, cert_pem = successor.issue("leasekeeper", server=True)
    replace(files.cert, cert_pem)  # the key still belongs to the old certificate
    for _ in range(3):
        assert await health_over(target, trusting(server_ca)) is grpc.StatusCode.OK
    replace(files.key, key_pem)
    await poll_until_ok(target, trusting(successor))


async def test_client_ca_rotation_reaches_new_connections(
    mtls_server: RunningServer, files: ServerFiles, server_ca: Authority, client_ca: Authority
) -> None:
    target = mtls_server.target
    old_client = client_ca.issue("old", server=False)
    assert await health_over(target, trusting(server_ca, old_client)) is grpc.StatusCode.OK
    new_ca = Authority.make("client-ca-2")
    replace(files.client_ca, new_ca.pem)
    await poll_until_ok(target, trusting(server_ca, new_ca.issue("new", server=False)))
    assert await health_over(target, trusting(server_ca, old_client)) is grpc.StatusCode.UNAVAILABLE


async def test_token_over_tls_with_auth_on(
    database_url: str,
    files: ServerFiles,
    server_ca: Authority,
    db: asyncpg.Connection,
    namespace: str,
) -> None:
    _record, token = await tokens.create_token(db, "tls-worker", "worker", [namespace])
    async with (
        running_server(
            database_url, auth="on", tls_cert_file=files.cert, tls_key_file=files.key
        ) as server,
        LeaseClient(
            server.target, namespace, token=token, credentials=trusting(server_ca)
        ) as client,
    ):
        assert (await client.claim("t")).acquired


async def test_unloadable_certificate_fails_the_start(
    database_url: str, files: ServerFiles, server_ca: Authority
) -> None:
    other_key, _cert = server_ca.issue("other", server=True)
    files.key.write_bytes(other_key)  # does not match the certificate
    settings = make_settings(database_url, tls_cert_file=files.cert, tls_key_file=files.key)
    with pytest.raises(ValueError, match="TLS certificate") as caught:
        await LeaseServer(settings, database_url).start()
    assert str(files.cert) in str(caught.value)


def test_tls_settings_need_certificate_and_key_together(files: ServerFiles) -> None:
    with pytest.raises(pydantic.ValidationError, match="tls_cert_file and tls_key_file"):
        make_settings("postgresql://unused", tls_cert_file=files.cert)
    with pytest.raises(pydantic.ValidationError, match="tls_client_ca_file"):
        make_settings("postgresql://unused", tls_client_ca_file=files.client_ca)


async def test_plaintext_health_port_answers_probes_that_cannot_speak_tls(
    database_url: str, files: ServerFiles
) -> None:
    # Kubernetes' gRPC probes speak plaintext only: LEASEKEEPER_HEALTH_LISTEN
    # serves grpc.health.v1, and nothing else, on a second port.
    async with running_server(
        database_url,
        tls_cert_file=files.cert,
        tls_key_file=files.key,
        tls_client_ca_file=files.client_ca,
        health_listen="127.0.0.1:0",
    ) as running:
        health_target = f"127.0.0.1:{running.server.health_port}"
        assert await health_over(health_target, None) == grpc.StatusCode.OK
        assert await health_over(running.target, None) == grpc.StatusCode.UNAVAILABLE
        async with grpc.aio.insecure_channel(health_target) as channel:
            try:
                await rpc.LeaseServiceStub(channel).GetLease(
                    pb.GetLeaseRequest(namespace="n", task_id="t"), timeout=5
                )
                raise AssertionError("the health port served the lease service")
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.UNIMPLEMENTED
