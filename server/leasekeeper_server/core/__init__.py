"""The domain: what a lease, a fence and an effect are, and the rules that decide them.

Pure code: no gRPC, no SQL, no clock. ``model`` holds the lease and its
states, ``effect_rules`` the effect ledger's decisions, ``limits`` the
per-namespace limits and the claim bucket rule, ``errors`` the service's
errors (each mapped to one gRPC status in ``rpc.status``).

Invariant: every instant a rule compares comes from the database's clock,
carried in the value it judges (``db_now``); nothing here reads a clock.
"""
