"""The ``leasekeeper`` command: serve, migrate, inspect and operate.

``main`` parses the command line; ``startup`` starts one server process;
``supervisor`` runs ``serve --workers N`` (N server processes on one port);
``remote`` calls a running server, ``admin`` and ``limits`` manage the
database directly, ``output`` prints tables or JSON, ``healthcheck`` is the
container probe.

Invariant: a start that can never work exits 2 with one line; one that may
work later exits 1 with one line; no traceback reaches the terminal.
"""
