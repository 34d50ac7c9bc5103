"""The RPC surface: the ``leasekeeper.v1.LeaseService`` handlers and their plumbing.

``servicer`` holds the unary handlers, ``heartbeat`` and ``watch`` the two
streams, ``validate`` turns requests into checked domain values, ``convert``
turns domain values into messages, ``paging`` signs page tokens, ``status``
maps every domain error to one gRPC status, ``handling`` parses requests and
aborts calls.

Invariants: a handler validates, calls storage once for its decision, and
converts back; it never writes SQL, never reads a clock to decide, and never
touches metrics (``observability.observe`` sees every call). A request that
cannot be parsed or validated changes nothing and is refused naming its field.
"""
