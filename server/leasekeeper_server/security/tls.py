"""TLS and mutual TLS on the gRPC port, with certificates reloaded from files.

The server's credentials come from ``grpc.dynamic_ssl_server_credentials``:
gRPC asks :meth:`CertificateFiles.fetch` at every new handshake, and it hands
over a new configuration when a file's mtime, size or inode changed since the
last load. Connections already open keep the certificate they were made
with; new ones get the new certificate, without a restart.

A rotation writes files one by one, so a handshake may come between the new
certificate and its key: a pair that does not match (or a file that does not
parse) is not loaded; the previous configuration stays, and the files are
read again at the next handshake until they agree.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from leasekeeper_server.settings import Settings

# Named as before the move to security/: log filters and JSON logs' ``logger`` match it.
log = logging.getLogger("leasekeeper_server.tls")

Stamp = tuple[tuple[int, int, int] | None, ...]


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files of the server's TLS identity.

    Attributes:
        cert_file: The server's certificate chain.
        key_file: The certificate's private key.
        client_ca_file: CA certificates that sign client certificates; set:
            mutual TLS, every client must present a certificate they sign.
    """

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> TlsFiles | None:
        """The settings' TLS files; None when TLS is not configured."""
        if settings.tls_cert_file is None or settings.tls_key_file is None:
            return None
        return cls(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)

    @property
    def paths(self) -> tuple[Path, ...]:
        """Every file, certificate first."""
        files = (self.cert_file, self.key_file)
        return (*files, self.client_ca_file) if self.client_ca_file else files


def _stamp(paths: tuple[Path, ...]) -> Stamp:
    stamps: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            stamps.append(None)
        else:
            stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(stamps)


def load_configuration(files: TlsFiles) -> grpc.ServerCertificateConfiguration:
    """Reads and checks the files: the key must match the certificate, the CA file must parse.

    Raises:
        ValueError: a file is missing, unreadable or malformed, or the key
            does not match the certificate (the message names the file).
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(files.cert_file, files.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"TLS certificate {files.cert_file} with key {files.key_file}: {exc}"
        ) from exc
    client_ca: bytes | None = None
    if files.client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=files.client_ca_file)
            client_ca = files.client_ca_file.read_bytes()
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"TLS client CA file {files.client_ca_file}: {exc}") from exc
    try:
        pair = (files.key_file.read_bytes(), files.cert_file.read_bytes())
    except OSError as exc:
        raise ValueError(f"TLS files: {exc}") from exc
    return grpc.ssl_server_certificate_configuration([pair], root_certificates=client_ca)


class CertificateFiles:
    """Server credentials from PEM files, reloaded when the files change.

    Args:
        files: The certificate, key and (for mutual TLS) client CA files.

    Raises:
        ValueError: the files cannot be loaded at start (see :func:`load_configuration`).
    """

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()  # gRPC calls fetch() from its own threads
        self._stamp = _stamp(files.paths)
        self._initial = load_configuration(files)
        self._failed_stamp: Stamp | None = None
        self.reloads = 0

    @property
    def mutual(self) -> bool:
        """Whether clients must present a certificate signed by the client CA."""
        return self.files.client_ca_file is not None

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials for ``server.add_secure_port``, reloading on change."""
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self.fetch, require_client_authentication=self.mutual
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration if the files changed and load; else None (keep the current one)."""
        with self._lock:
            stamp = _stamp(self.files.paths)
            if stamp == self._stamp:
                return None
            try:
                configuration = load_configuration(self.files)
            except ValueError as exc:
                if stamp != self._failed_stamp:  # once per state of the files, not per handshake
                    log.error("TLS files changed but cannot be loaded, keeping the last: %s", exc)
                    self._failed_stamp = stamp
                return None
            self._stamp = stamp
            self.reloads += 1
            log.info("TLS certificate reloaded from %s", self.files.cert_file)
            return configuration
