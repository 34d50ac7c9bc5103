"""leasekeeper_server: the lease service (grpc.aio on PostgreSQL through asyncpg)."""

__version__ = "0.1.0"
