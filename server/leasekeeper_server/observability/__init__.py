"""What the service tells its operators: metrics, traces, logs, audit records and health.

``observe`` is the outermost interceptor: the one place a call's metrics,
span and audit record are made. ``metrics``, ``tracing``, ``logs`` and
``audit`` are its outputs; ``health`` serves the gRPC health protocol from
how the database's statements end.

Invariant: observing never changes a call's outcome; a metric or log failure
is not the caller's error.
"""
