# leasekeeper: the lease service. Multi-stage; runs as a non-root user.
#   docker build -t leasekeeper .
#   docker run -p 9457:9457 -e LEASEKEEPER_DATABASE_URL=postgresql://... leasekeeper
# With no LEASEKEEPER_DATABASE_URL the image starts its embedded PostgreSQL in
# /data (mount a volume there to keep it). It listens on 0.0.0.0, so tokens are
# required (LEASEKEEPER_AUTH=auto): create them with `leasekeeper tokens create`
# or mount a LEASEKEEPER_TOKENS_FILE (README: Operations).

# The base of both stages: any image with Python 3.11 (python, python -m venv) and
# Debian's groupadd/useradd. CI's `make image-test` (tests/image/) passes a Debian
# bookworm base it makes with debootstrap, and needs no registry.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY client client
COPY server server
COPY migrations migrations
COPY protos protos
COPY scripts scripts
RUN python -m venv /opt/leasekeeper \
 && /opt/leasekeeper/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/leasekeeper/bin/pip install --no-cache-dir '.[server]'

FROM ${BASE_IMAGE}
# uid and gid 10001: deploy/k8s/deployment.yaml runs the pod as 10001:10001.
RUN groupadd --system --gid 10001 leasekeeper \
 && useradd --system --uid 10001 --gid 10001 --home-dir /data --create-home leasekeeper
COPY --from=build /opt/leasekeeper /opt/leasekeeper
ENV PATH=/opt/leasekeeper/bin:$PATH \
    LEASEKEEPER_LISTEN=0.0.0.0:9457 \
    LEASEKEEPER_HEALTH_LISTEN=127.0.0.1:9459 \
    LEASEKEEPER_DATA_DIR=/data/pgdata \
    PYTHONUNBUFFERED=1
USER leasekeeper
WORKDIR /data
EXPOSE 9457
# Healthy only while the gRPC health service says SERVING (it follows the
# database); asked on the plaintext health-only port, so TLS on 9457 changes nothing.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-m", "leasekeeper_server.cli.healthcheck", "127.0.0.1:9459"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["leasekeeper"]
CMD ["serve"]
