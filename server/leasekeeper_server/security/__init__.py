"""Security: who may call what, and the TLS identity of the gRPC port.

- ``roles``: roles, what each may call, the principal a token stands for;
- ``mode``: whether this server asks for tokens, and the startup line;
- ``token_file``: the token file, reloaded when it changes;
- ``authenticator``: a token to a principal, from the file and the database (cached);
- ``caller``: the current call's principal, and the re-check that ends long calls;
- ``interceptor``: the gRPC interceptor that refuses a call before its handler runs;
- ``tls``: TLS and mutual TLS, certificates reloaded from files.

Token text, digests, the database store and the token file format live in
:mod:`leasekeeper_server.tokens` (``python -m leasekeeper_server.tokens``).

The names below are the package's surface for tests that read it as one
namespace; server modules import from the module that owns a name.
"""

from .authenticator import Authenticator
from .caller import authorize_namespace, current_principal, guard_credentials
from .interceptor import AuthInterceptor
from .mode import auth_enabled, log_startup
from .roles import ROLE_METHODS, Principal
from .token_file import TokenFile

__all__ = [
    "ROLE_METHODS",
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
