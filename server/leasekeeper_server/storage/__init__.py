"""Storage: PostgreSQL through asyncpg, the only clock and the only place a decision is taken.

``store`` runs the lease statements (batched through ``batch``), ``ledger``
the effect ledger's transactions, ``events`` the LISTEN connection that
fans out change notifications, ``sweeper`` announces expiries, ``migrate``
applies ``migrations/``, ``pooling`` refuses a pooler that would break
sessions, ``embedded`` starts PostgreSQL when none is configured, and
``sql/`` holds every statement by name.

Invariants: each decision is one statement that reads ``clock_timestamp()``
after it holds the row; driver errors leave this package translated
(``DatabaseUnavailable``, ``DatabaseRefused``), never raw.
"""
