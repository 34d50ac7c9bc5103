"""The lease service's full gRPC name, ``leasekeeper.v1.LeaseService``, read from the proto.

Defined once here: the handlers' registration, the health service's names,
authorization, the call interceptor, the tracing spans and the health probe
all use it.
"""

from __future__ import annotations

from leasekeeper.v1 import lease_service_pb2 as pb

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["LeaseService"].full_name
