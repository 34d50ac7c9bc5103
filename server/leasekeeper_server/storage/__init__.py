"""Storage: PostgreSQL through asyncpg, the only clock and the only place a decision is taken.

``store`` runs the lease statements (batched through ``batch``), ``ledger``
the effect ledger's (a statement per call, batched too), ``events`` the LISTEN connection that
fans out change notifications, ``sweeper`` announces expiries, ``migrate``
applies ``migrations/``, ``pooling`` says how statements reach PostgreSQL in
the pool mode (session, or a transaction pooler) and refuses at start a pooler
that cannot work, ``embedded`` starts PostgreSQL when none is configured, and
``sql/`` holds every statement by name.

Invariants: each decision is one statement that reads ``clock_timestamp()``
after it holds the row; driver errors leave this package translated
(``DatabaseUnavailable``, ``DatabaseRefused``), never raw.
"""
