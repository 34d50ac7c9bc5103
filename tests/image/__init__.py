"""The container image, built and run without Docker: `make image-test` (tests/image/run.py).

This machine has no Docker engine and reaches no image registry, so the image is
built the way any Debian host can: ``debootstrap`` makes a Debian bookworm base
with Python 3.11 (cached in ``build/image/``), ``buildah bud --isolation chroot``
builds the Dockerfile on it (``--build-arg BASE_IMAGE``; the RUN steps' pip gets the
host's CA bundle and pip configuration as read-only mounts), and ``buildah run
--isolation chroot`` on the host network starts the image's entrypoint twice: on
its embedded PostgreSQL and on the machine's PostgreSQL. Each run must answer
SERVING to the image's own health check, grant a claim to a token's holder,
refuse one without a token, and drain on SIGTERM to exit status 0 with no
process of the container left (the embedded PostgreSQL stopped with it).
``build/image/report.txt`` keeps what was measured. Needs root (debootstrap,
buildah's chroot isolation); ``.ci/run`` installs Debian's debootstrap and buildah.
"""
