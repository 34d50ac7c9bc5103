"""Roles, what each may call, and the principal a token stands for.

``admin`` may call every RPC; ``worker`` and ``effect`` may call the methods
listed in ``ROLE_METHODS`` (the proto's "Access:" table). A principal covers
the namespaces its patterns match: exact, ``*``, or a prefix ending in ``*``.
ListLeases, ListNamespaces and GetNamespaceStats, the operators' listings and
figures, are admin's alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# The proto's "Access:" table. admin may call every RPC, including any not listed.
ROLE_METHODS: dict[str, frozenset[str]] = {
    "worker": frozenset(
        {
            "Claim",
            "Renew",
            "Release",
            "Heartbeat",
            "Session",
            "GetLease",
            "Watch",
            "BeginEffect",
            "CompleteEffect",
            "ListEffects",
            "SaveCheckpoint",
            "ListTaskHistory",
        }
    ),
    "effect": frozenset(
        {
            "ValidateFence",
            "ValidateFences",
            "GetLease",
            "BeginEffect",
            "CompleteEffect",
            "ListEffects",
            "ListTaskHistory",
        }
    ),
}

# Methods whose request names no namespace: the interceptor checks their role
# only, and the handler answers only about the namespaces the caller's token
# covers (ListNamespaces leaves out the others).
UNSCOPED_METHODS: frozenset[str] = frozenset({"ListNamespaces"})

Source = Literal["file", "database"]


@dataclass(frozen=True)
class Principal:
    """The caller a token stands for.

    Attributes:
        name: The token's name (never the token), for logs.
        role: ``worker``, ``effect`` or ``admin``.
        namespaces: Namespace patterns: exact, ``*``, or a prefix ending in ``*``.
        source: Where the token was found: ``file`` or ``database``.
    """

    name: str
    role: str
    namespaces: tuple[str, ...]
    source: Source

    def may_call(self, method: str) -> bool:
        """Whether the role includes the LeaseService method (its short name, e.g. ``Claim``)."""
        return self.role == "admin" or method in ROLE_METHODS.get(self.role, frozenset())

    def covers(self, namespace: str) -> bool:
        """Whether a namespace pattern covers ``namespace`` (byte for byte)."""
        for pattern in self.namespaces:
            if pattern.endswith("*"):
                if namespace.startswith(pattern[:-1]):
                    return True
            elif namespace == pattern:
                return True
        return False
