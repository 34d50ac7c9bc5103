"""Security: who may call what, and the TLS identity of the gRPC port.

- ``roles``: roles, what each may call, the principal a token stands for;
- ``mode``: whether this server asks for tokens, and the startup line;
- ``token_file``: the token file, reloaded when it changes;
- ``authenticator``: a token to a principal, from the file and the database (cached);
- ``caller``: the current call's principal, and the re-check that ends long calls;
- ``interceptor``: the gRPC interceptor that refuses a call before its handler runs;
- ``tls``: TLS and mutual TLS, certificates reloaded from files.

Token text, digests, the database store and the token file format live in
:mod:`leasekeeper_server.security.tokens` (``python -m leasekeeper_server.cli.tokens``).

The names below are the package's surface for tests that read it as one
namespace; server modules import from the module that owns a name.
"""

from leasekeeper_server.security.authenticator import Authenticator
from leasekeeper_server.security.caller import (
    authorize_namespace,
    current_principal,
    guard_credentials,
)
from leasekeeper_server.security.interceptor import AuthInterceptor
from leasekeeper_server.security.mode import auth_enabled, log_startup
from leasekeeper_server.security.roles import ROLE_METHODS, UNSCOPED_METHODS, Principal
from leasekeeper_server.security.token_file import TokenFile

__all__ = [
    "ROLE_METHODS",
    "UNSCOPED_METHODS",
    "AuthInterceptor",
    "Authenticator",
    "Principal",
    "TokenFile",
    "auth_enabled",
    "authorize_namespace",
    "current_principal",
    "guard_credentials",
    "log_startup",
]
