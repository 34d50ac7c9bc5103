"""`make image-test`: build the Dockerfile on a debootstrapped base, and run the image twice.

::

    python -m tests.image.run [--mirror URL] [--admin-url URL]

Steps, each timed (package docstring: why this way):

1. **base**: ``debootstrap --variant=minbase`` of Debian bookworm with python3,
   python3-venv and python-is-python3 from the mirror apt uses, slimmed like
   Debian's slim images and kept as ``build/image/base.tar``; imported into
   buildah as ``BASE_IMAGE``. Both are reused while the recipe is unchanged.
2. **build**: ``buildah bud --isolation chroot --format docker`` (the docker format
   keeps HEALTHCHECK) with ``--build-arg BASE_IMAGE``, the host's pip configuration
   mounted at ``/etc/pip.conf`` and the paths it names (CA bundle, local indexes)
   mounted read-only.
3. **size**: the image's layers, uncompressed and as gzip (``buildah push oci:``).
4. **embedded** and **external**: a container of the image, its entrypoint started
   with ``buildah run --isolation chroot --network host`` as the image's user, on free
   ports, with a token file mounted; first on its embedded PostgreSQL, then on a
   database of its own created on the machine's PostgreSQL (``--admin-url``) and
   dropped afterwards.

Exits 0 when every check passed, 1 when one failed (its reason on stderr), 2 when
a tool is missing. ``build/image/report.txt`` keeps the figures; the logs of the
base, the build and each run are beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# Subprocesses are started from a process running grpc; its fork handlers have nothing to
# do then and only log noise (tests/conftest.py does the same). Read at grpc's import.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import asyncpg
import grpc
import psutil

from leasekeeper import AccessDenied, LeaseClient
from leasekeeper_server.cli.healthcheck import probe
from leasekeeper_server.security.tokens import file_entry, new_token
from tests.image.hostconfig import (
    INDEXTARGETS_FORMAT,
    debian_mirror,
    host_ca_bundle,
    pip_for_build,
)

REPO = Path(__file__).resolve().parents[2]
WORK = REPO / "build" / "image"
SUITE = "bookworm"
# What the Dockerfile needs of its base: `python -m venv` (python-is-python3, python3-venv),
# and what python:3.11-slim also has (CA certificates, /etc/services and /etc/protocols).
PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates", "netbase")
# Left out of the base after debootstrap, as Debian's slim images leave them out: apt's
# downloads and lists (the files in these folders), manuals and translations (these folders'
# contents), and documentation but for the copyright files.
SLIM_FILES_IN = ("var/cache/apt", "var/cache/apt/archives", "var/lib/apt/lists")
SLIM_TREES = ("usr/share/man", "usr/share/info", "usr/share/locale")
RECIPE_VERSION = 1  # bump when the base's recipe changes in a way the key does not see
BASE_IMAGE = f"localhost/leasekeeper-image-test/base:{SUITE}"
IMAGE = "localhost/leasekeeper-image-test/leasekeeper:latest"
BASE_KEY_LABEL = "leasekeeper.image-test.base-key"
IMAGE_UID = 10001  # the Dockerfile's useradd --uid
NAMESPACE = "image-test"
TOKENS_IN_CONTAINER = "/etc/leasekeeper/tokens.toml"
LOCAL_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
READY_WITHIN_S = 120.0  # the image's first start migrates the schema (embedded: initdb too)
DRAIN_WITHIN_S = 30.0  # LEASEKEEPER_SHUTDOWN_GRACE_S (10 s) and the embedded PostgreSQL's stop
GONE_WITHIN_S = 10.0


class Failed(Exception):
    """A check failed; the message says which and what was found."""


@dataclass
class Report:
    """What was measured, printed as it comes and written to build/image/report.txt."""

    lines: list[str] = field(default_factory=list)
    steps: list[tuple[str, float]] = field(default_factory=list)

    def note(self, text: str) -> None:
        print(f"image-test: {text}", flush=True)
        self.lines.append(text)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        print(f"image-test: == {name}", flush=True)
        start = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - start
            self.steps.append((name, took))
            print(f"image-test: == {name}: {took:.1f} s", flush=True)

    def write(self, outcome: str) -> Path:
        total = sum(took for _, took in self.steps)
        timings = ", ".join(f"{name} {took:.1f} s" for name, took in self.steps)
        text = "\n".join(
            [
                f"leasekeeper image test, {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC: {outcome}",
                *self.lines,
                f"steps: {timings}; total {total:.1f} s",
                "",
            ]
        )
        path = WORK / "report.txt"
        path.write_text(text)
        return path


def sh(
    args: Sequence[str | Path],
    *,
    timeout: float = 120.0,
    log: Path | None = None,
    cwd: Path | None = None,
) -> str:
    """Run a command; its standard output (or, with ``log``, everything it printed there).

    Raises:
        Failed: it exited non-zero or outlasted ``timeout`` seconds; the message carries
            the end of what it printed.
    """
    command = [str(a) for a in args]
    try:
        if log is None:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd)
            output, errors = done.stdout, done.stderr
        else:
            with log.open("w") as out:
                done = subprocess.run(
                    command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=cwd
                )
            output = errors = log.read_text()
    except subprocess.TimeoutExpired as exc:
        raise Failed(f"{command[0]} {command[1]}: no end within {timeout:.0f} s") from exc
    if done.returncode != 0:
        tail = "\n".join(errors.strip().splitlines()[-25:])
        raise Failed(f"{' '.join(command[:3])} ...: exit {done.returncode}\n{tail}")
    return output


def megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


# --- 1. the base --------------------------------------------------------------------------


def base_key(mirror: str) -> str:
    recipe = {
        "suite": SUITE,
        "mirror": mirror,
        "packages": PACKAGES,
        "slim": [SLIM_FILES_IN, SLIM_TREES],
        "version": RECIPE_VERSION,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path`` (debootstrap mounts /proc and /sys in its target)."""
    inside = str(path.resolve())
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if point == inside or point.startswith(inside + "/"):
            found.append(point)
    return found


def remove_tree(path: Path) -> None:
    """Remove a debootstrap target, never following a mount left in it into the host."""
    for point in sorted(mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", point], check=False)
    left = mounts_under(path)
    if left:
        raise Failed(f"still mounted, not removing {path}: {left}")
    if path.exists():
        shutil.rmtree(path)


def make_base_tar(mirror: str, tar: Path, report: Report) -> None:
    """debootstrap the base into a folder, slim it, check its Python, and tar it."""
    rootfs = WORK / "rootfs"
    remove_tree(rootfs)
    log = WORK / "debootstrap.log"
    try:
        sh(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(PACKAGES)}",
                SUITE,
                rootfs,
                mirror,
            ],
            timeout=600,
            log=log,
        )
        for folder in SLIM_FILES_IN:
            for child in (rootfs / folder).glob("*"):
                if child.is_file():
                    child.unlink()
        for tree in SLIM_TREES:
            for child in (rootfs / tree).glob("*"):
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        for doc in (rootfs / "usr/share/doc").rglob("*"):
            if doc.is_file() and doc.name != "copyright":
                doc.unlink()
        version = sh(["chroot", rootfs, "python", "--version"]).strip()
        if not version.startswith("Python 3.11."):
            raise Failed(f"the base's python is {version}, the Dockerfile's is 3.11")
        sh(["chroot", rootfs, "python", "-c", "import ensurepip, venv"])
        report.note(f"base: debootstrap {SUITE} from {mirror}, {version} (log {log})")
        partial = tar.with_suffix(".tar.partial")
        excludes = [f"--exclude=./{d}/*" for d in ("dev", "proc", "sys", "run", "tmp")]
        sh(["tar", "-C", rootfs, "--numeric-owner", "-cf", partial, *excludes, "."])
        partial.replace(tar)
    finally:
        remove_tree(rootfs)


def image_id(name: str) -> str | None:
    """The local image's full id, or None when there is no such image."""
    done = subprocess.run(
        ["buildah", "images", "--no-trunc", "--quiet", name],
        capture_output=True,
        text=True,
        check=False,
    )
    ids = done.stdout.split()
    return ids[0] if done.returncode == 0 and ids else None


def inspect_image(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(sh(["buildah", "inspect", "--type", "image", name]))
    return data


def ensure_base(mirror: str, report: Report) -> None:
    """BASE_IMAGE made from the cached tar (debootstrapped first when missing or stale)."""
    key = base_key(mirror)
    tar, key_file = WORK / "base.tar", WORK / "base.key"
    if image_id(BASE_IMAGE) is not None:
        labels = inspect_image(BASE_IMAGE)["Docker"]["config"].get("Labels") or {}
        if labels.get(BASE_KEY_LABEL) == key:
            report.note(f"base: {BASE_IMAGE} reused (recipe {key})")
            return
    if not (tar.is_file() and key_file.is_file() and key_file.read_text().strip() == key):
        make_base_tar(mirror, tar, report)
        key_file.write_text(f"{key}\n")
    else:
        report.note(f"base: {tar} reused (recipe {key})")
    old = image_id(BASE_IMAGE)
    name = f"leasekeeper-image-test-base-{os.getpid()}"
    sh(["buildah", "from", "--name", name, "scratch"])
    try:
        sh(["buildah", "add", name, tar, "/"], timeout=300)
        sh(
            [
                "buildah",
                "config",
                "--env",
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--env",
                "LANG=C.UTF-8",
                "--cmd",
                "python3",
                "--label",
                f"{BASE_KEY_LABEL}={key}",
                name,
            ]
        )
        sh(["buildah", "commit", "--quiet", "--format", "docker", name, BASE_IMAGE], timeout=300)
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True, check=False)
    if old is not None and old != image_id(BASE_IMAGE):
        subprocess.run(["buildah", "rmi", old], capture_output=True, check=False)
    report.note(f"base: imported as {BASE_IMAGE} (recipe {key})")


# --- 2. the build -------------------------------------------------------------------------


def build_image(report: Report) -> None:
    """``buildah bud`` of the Dockerfile on BASE_IMAGE, pip configured as on the host."""
    config_list = sh([sys.executable, "-m", "pip", "config", "list"])
    pip = pip_for_build(config_list, default_cert=host_ca_bundle())
    old = image_id(IMAGE)
    log = WORK / "build.log"
    with tempfile.TemporaryDirectory(prefix="leasekeeper-image-pip-") as tmp:
        # It may carry an index's credentials: never in build/, gone after the build.
        conf = Path(tmp) / "pip.conf"
        conf.write_text(pip.config)
        conf.chmod(0o644)
        volumes = [f"{conf}:/etc/pip.conf:ro", *(f"{p}:{p}:ro" for p in pip.paths)]
        sh(
            [
                "buildah",
                "bud",
                "--isolation",
                "chroot",
                "--format",
                "docker",
                "--pull=never",
                "--build-arg",
                f"BASE_IMAGE={BASE_IMAGE}",
                *(arg for volume in volumes for arg in ("-v", volume)),
                "-t",
                IMAGE,
                "-f",
                REPO / "Dockerfile",
                REPO,
            ],
            timeout=900,
            log=log,
            cwd=REPO,
        )
    new = image_id(IMAGE)
    if old is not None and old != new:
        subprocess.run(["buildah", "rmi", old], capture_output=True, check=False)
    mounted = ", ".join(["/etc/pip.conf", *map(str, pip.paths)])
    short_id = (new or "?").removeprefix("sha256:")[:12]
    report.note(f"build: {IMAGE} {short_id} on {BASE_IMAGE} (mounted: {mounted}; log {log})")
    check_no_build_config_left(volumes, report)


def check_no_build_config_left(volumes: list[str], report: Report) -> None:
    """The build's mounts left nothing of the host's in the image.

    buildah 1.28 leaves the mount points it had to make (empty files and folders) in
    the image's layers. Each mount target must be, in the image, either the base's
    own file or folder, unchanged (a file with the base's bytes), or such an empty
    mount point (listed in the report).
    """
    looks = {
        image: f"leasekeeper-image-test-look-{os.getpid()}-{n}"
        for n, image in enumerate((IMAGE, BASE_IMAGE))
    }
    try:
        roots = {}
        for image, name in looks.items():
            sh(["buildah", "from", "--pull=never", "--name", name, image])
            roots[image] = Path(sh(["buildah", "mount", name]).strip())
        leftovers = []
        for volume in volumes:
            target = Path(volume.split(":")[1]).relative_to("/")
            inside, in_base = roots[IMAGE] / target, roots[BASE_IMAGE] / target
            if not inside.exists() and not inside.is_symlink():
                continue
            if in_base.exists() or in_base.is_symlink():
                if in_base.is_file() and inside.read_bytes() != in_base.read_bytes():
                    raise Failed(f"the image's /{target} differs from the base's: a mount leaked")
                continue
            empty = not any(inside.iterdir()) if inside.is_dir() else inside.stat().st_size == 0
            if not empty:
                raise Failed(f"the image's /{target} is not empty: a build mount leaked")
            leftovers.append(f"/{target}{'/' if inside.is_dir() else ''}")
        if leftovers:
            report.note(f"build: empty mount points left in the image: {', '.join(leftovers)}")
    finally:
        for name in looks.values():
            subprocess.run(["buildah", "umount", name], capture_output=True, check=False)
            subprocess.run(["buildah", "rm", name], capture_output=True, check=False)


# --- 3. the size --------------------------------------------------------------------------


def layer_sizes(name: str) -> list[int]:
    """The image's layers, uncompressed bytes, from its manifest in local storage."""
    manifest = json.loads(inspect_image(name)["Manifest"])
    return [int(layer["size"]) for layer in manifest["layers"]]


def measure_size(report: Report) -> None:
    image, base = sum(layer_sizes(IMAGE)), sum(layer_sizes(BASE_IMAGE))
    with tempfile.TemporaryDirectory(prefix="leasekeeper-image-oci-") as tmp:
        sh(["buildah", "push", "--quiet", IMAGE, f"oci:{tmp}/oci"], timeout=300)
        index = json.loads(Path(tmp, "oci", "index.json").read_text())
        digest = index["manifests"][0]["digest"].removeprefix("sha256:")
        manifest = json.loads(Path(tmp, "oci", "blobs", "sha256", digest).read_text())
        packed = sum(int(layer["size"]) for layer in manifest["layers"])
        base_layers = len(layer_sizes(BASE_IMAGE))
        packed_base = sum(int(layer["size"]) for layer in manifest["layers"][:base_layers])
    mb = megabytes
    report.note(
        f"size: {mb(image)} uncompressed (base {mb(base)}, leasekeeper's layers "
        f"{mb(image - base)}); {mb(packed)} as gzip layers (base {mb(packed_base)}, "
        f"leasekeeper's {mb(packed - packed_base)})"
    )


# --- 4. the runs --------------------------------------------------------------------------


# What the server prints once each port is bound (it is started on port 0: any free port).
BOUND = {
    "grpc": re.compile(r"^leasekeeper listening on \S+:(\d+)$", re.MULTILINE),  # its stdout line
    "health": re.compile(r"plaintext health service on \S+ \(port (\d+)\)"),
    "console": re.compile(r"leasekeeper console on http://127\.0\.0\.1:(\d+)/"),
}


def bound_ports(log: Path) -> dict[str, int] | None:
    """The ports the server's output says it bound, once it said all of them."""
    text = log.read_text(errors="replace")
    found = {name: pattern.search(text) for name, pattern in BOUND.items()}
    if not all(found.values()):
        return None
    return {name: int(match[1]) for name, match in found.items() if match}


def root_of(pid: int) -> str | None:
    """The root folder a process sees (its chroot), or None once it is gone."""
    try:
        return os.readlink(f"/proc/{pid}/root")
    except OSError:
        return None


def processes_in(root: str) -> list[psutil.Process]:
    """Every process whose root is ``root``: the container's, wherever they were reparented."""
    return [p for p in psutil.process_iter() if root_of(p.pid) == root]


def wait_for(what: str, check: Callable[[], Any], within_s: float, every_s: float = 0.2) -> Any:
    """Poll ``check`` until it returns something true; that value.

    Raises:
        Failed: still false after ``within_s`` seconds.
    """
    deadline = time.monotonic() + within_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise Failed(f"{what}: not within {within_s:.0f} s")
        time.sleep(every_s)


def entrypoint_process(runner: subprocess.Popen[bytes]) -> psutil.Process | None:
    """The image's entrypoint: the child buildah's chroot helper started (there is no PID 1)."""
    try:
        below = psutil.Process(runner.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for process in below:
        with contextlib.suppress(psutil.Error, IndexError):
            if process.parent().cmdline()[0] == "buildah-chroot-exec":
                return process
    return None


@dataclass
class Run:
    """One start of the image: what to give it, and what was seen."""

    mode: str  # "embedded" or "external"
    database_url: str | None
    token: str
    tokens_file: Path


async def claim_checks(target: str, run: Run) -> str:
    """A claim granted with the token, and one refused without it; a line saying so."""
    async with LeaseClient(target, namespace=NAMESPACE, token=run.token) as client:
        result = await client.claim(f"image-{run.mode}", ttl=30.0)
    if not result.acquired or result.lease is None or result.lease.fence < 1:
        raise Failed(f"{run.mode}: claim not granted: {result}")
    try:
        async with LeaseClient(target, namespace=NAMESPACE) as anonymous:
            await anonymous.claim(f"image-{run.mode}-anonymous", ttl=30.0)
    except AccessDenied as exc:
        if exc.code is not grpc.StatusCode.UNAUTHENTICATED:
            raise Failed(f"{run.mode}: a claim without a token got {exc.code}") from exc
    else:
        raise Failed(f"{run.mode}: a claim without a token was answered (listening on 0.0.0.0)")
    return f"claim granted (fence {result.lease.fence}), without a token UNAUTHENTICATED"


def run_image(run: Run, config: dict[str, Any], report: Report) -> None:
    """Start the image's entrypoint in a fresh container; check it; SIGTERM it; check it is gone."""
    # On the host's network: port 0 everywhere (the image's own ports may be taken here).
    env = {
        "LEASEKEEPER_LISTEN": "0.0.0.0:0",
        "LEASEKEEPER_HEALTH_LISTEN": "127.0.0.1:0",
        "LEASEKEEPER_CONSOLE_LISTEN": "127.0.0.1:0",
        "LEASEKEEPER_TOKENS_FILE": TOKENS_IN_CONTAINER,
    }
    if run.database_url is not None:
        env["LEASEKEEPER_DATABASE_URL"] = run.database_url
    command = [*config["Entrypoint"], *(config.get("Cmd") or [])]
    name = f"leasekeeper-image-test-{run.mode}"
    subprocess.run(["buildah", "rm", name], capture_output=True, check=False)  # a crashed run's
    sh(["buildah", "from", "--pull=never", "--name", name, IMAGE])
    log = WORK / f"run-{run.mode}.log"
    runner: subprocess.Popen[bytes] | None = None
    root = None
    try:
        chroot = ["buildah", "run", "--isolation", "chroot", "--network", "host"]
        uid = sh([*chroot, name, "--", "id", "-u"]).strip()
        if uid != str(IMAGE_UID):
            raise Failed(f"{run.mode}: buildah run runs the image as uid {uid}, not {IMAGE_UID}")
        started = time.monotonic()
        with log.open("wb") as out:
            runner = subprocess.Popen(
                [
                    *chroot,
                    *(arg for key, value in env.items() for arg in ("-e", f"{key}={value}")),
                    "-v",
                    f"{run.tokens_file}:{TOKENS_IN_CONTAINER}:ro",
                    name,
                    "--",
                    *command,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

        def exited() -> None:
            if runner is not None and runner.poll() is not None:
                tail = "\n".join(log.read_text().splitlines()[-20:])
                raise Failed(f"{run.mode}: {' '.join(command)} exited {runner.returncode}\n{tail}")

        def entrypoint() -> psutil.Process | None:
            exited()
            return entrypoint_process(runner)

        def listening() -> dict[str, int] | None:
            exited()
            return bound_ports(log)

        def serving() -> bool:
            exited()
            return probe(health, timeout_s=1.0)

        entry = wait_for(f"{run.mode}: the entrypoint's process", entrypoint, 30.0)
        root = root_of(entry.pid)
        ports = wait_for(f"{run.mode}: its ports in {log}", listening, READY_WITHIN_S)
        target, health = f"127.0.0.1:{ports['grpc']}", f"127.0.0.1:{ports['health']}"
        wait_for(f"{run.mode}: health SERVING on {health}", serving, READY_WITHIN_S)
        ready_s = time.monotonic() - started
        if entry.uids().real != IMAGE_UID:
            raise Failed(f"{run.mode}: the server runs as uid {entry.uids().real}")
        # The image's HEALTHCHECK, run in the container, asked on this run's health port.
        test = config["Healthcheck"]["Test"]
        if test[0] != "CMD" or test[-1] != config_env(config)["LEASEKEEPER_HEALTH_LISTEN"]:
            raise Failed(f"HEALTHCHECK {test} does not ask LEASEKEEPER_HEALTH_LISTEN")
        answer = sh([*chroot, name, "--", *test[1:-1], health]).strip()
        if answer != f"{health}: SERVING":
            raise Failed(f"{run.mode}: the image's health check said {answer!r}")
        claims = asyncio.run(claim_checks(target, run))
        console_url = f"http://127.0.0.1:{ports['console']}/signin"
        with urllib.request.urlopen(console_url, timeout=5) as page:
            console = f"console /signin {page.status}"
        postgres = [p for p in processes_in(root) if p.name() == "postgres"]
        if run.database_url is None:
            if not postgres or any(p.uids().real != IMAGE_UID for p in postgres):
                raise Failed(f"embedded: postgres processes as uid 10001: {postgres}")
        elif postgres:
            raise Failed(f"external: a PostgreSQL started in the container: {postgres}")

        stopping = time.monotonic()
        entry.send_signal(signal.SIGTERM)  # what `docker stop` sends to the entrypoint
        try:
            status = runner.wait(timeout=DRAIN_WITHIN_S)
        except subprocess.TimeoutExpired as exc:
            raise Failed(f"{run.mode}: not stopped {DRAIN_WITHIN_S:.0f} s after SIGTERM") from exc
        drained_s = time.monotonic() - stopping
        stopped_line = "leasekeeper stopped" in log.read_text()
        if status != 0 or not stopped_line:
            tail = "\n".join(log.read_text().splitlines()[-20:])
            raise Failed(f"{run.mode}: after SIGTERM exit {status}\n{tail}")
        left = processes_in(root)
        if left:  # given a moment: a process may still be on its way out
            with contextlib.suppress(Failed):
                wait_for("", lambda: not processes_in(root), GONE_WITHIN_S)
            left = processes_in(root)
        if left:
            names = [f"{p.pid} {' '.join(p.cmdline())}" for p in left]
            raise Failed(f"{run.mode}: left running after the entrypoint exited: {names}")
        report.note(
            f"{run.mode}: uid {IMAGE_UID}; SERVING after {ready_s:.1f} s; HEALTHCHECK "
            f"{answer!r}; {claims}; {console}; postgres processes in the container "
            f"{len(postgres)}; SIGTERM: exit 0 after {drained_s:.1f} s, no process left "
            f"(log {log})"
        )
    finally:
        if runner is not None and runner.poll() is None:
            with contextlib.suppress(psutil.Error):
                for process in psutil.Process(runner.pid).children(recursive=True):
                    process.kill()
            runner.kill()
            runner.wait()
        if root is not None:  # ours: started by this run (the embedded PostgreSQL)
            for process in processes_in(root):
                with contextlib.suppress(psutil.Error):
                    process.kill()
        subprocess.run(["buildah", "rm", name], capture_output=True, check=False)


def config_env(config: dict[str, Any]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in config.get("Env") or [])


async def admin(url: str, sql: str) -> None:
    conn = await asyncpg.connect(url, timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def tasks_in(url: str) -> int:
    conn = await asyncpg.connect(url, timeout=5)
    try:
        count: int = await conn.fetchval(
            "SELECT count(*) FROM leasekeeper_tasks WHERE namespace = $1", NAMESPACE
        )
        return count
    finally:
        await conn.close()


@contextlib.contextmanager
def own_database(admin_url: str) -> Iterator[str]:
    """A fresh database on ``admin_url``'s server, dropped afterwards; its URL."""
    name = f"leasekeeper_image_{uuid.uuid4().hex[:10]}"
    try:
        asyncio.run(admin(admin_url, f'CREATE DATABASE "{name}"'))
    except (OSError, asyncpg.PostgresError) as exc:
        raise Failed(f"external: cannot create a database on {admin_url}: {exc}") from exc
    try:
        yield urllib.parse.urlsplit(admin_url)._replace(path=f"/{name}").geturl()
    finally:
        asyncio.run(admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.image.run", description=__doc__)
    parser.add_argument("--mirror", help="Debian mirror for debootstrap (default: apt's)")
    parser.add_argument(
        "--admin-url",
        default=LOCAL_ADMIN_URL,
        help=f"PostgreSQL where the external run's database is made (default {LOCAL_ADMIN_URL})",
    )
    args = parser.parse_args(argv)
    missing = [tool for tool in ("debootstrap", "buildah") if shutil.which(tool) is None]
    if missing or os.geteuid() != 0:
        print(
            f"image-test: needs root and Debian's debootstrap and buildah (missing: "
            f"{', '.join(missing) or 'root'}); .ci/run installs them",
            file=sys.stderr,
        )
        return 2
    WORK.mkdir(parents=True, exist_ok=True)
    report = Report()
    try:
        mirror = args.mirror or debian_mirror(
            sh(["apt-get", "indextargets", "--format", INDEXTARGETS_FORMAT]), SUITE
        )
        with report.step("base"):
            ensure_base(mirror, report)
        with report.step("build"):
            build_image(report)
        with report.step("size"):
            measure_size(report)
        config = inspect_image(IMAGE)["Docker"]["config"]
        _, secret = new_token()
        with tempfile.TemporaryDirectory(prefix="leasekeeper-image-tokens-") as tmp:
            tokens_file = Path(tmp) / "tokens.toml"
            tokens_file.write_text(file_entry(secret, "image-test", "worker", [NAMESPACE]))
            tokens_file.chmod(0o644)  # digests only; the image's user reads it
            Path(tmp).chmod(0o755)
            with report.step("embedded"):
                run_image(Run("embedded", None, secret, tokens_file), config, report)
            with report.step("external"), own_database(args.admin_url) as url:
                run_image(Run("external", url, secret, tokens_file), config, report)
                count = asyncio.run(tasks_in(url))
                if count != 1:
                    raise Failed(f"external: {count} tasks of {NAMESPACE} in {url}, not 1")
                report.note(f"external: its claim is the one task of {NAMESPACE} in {url}")
    except (Failed, LookupError, ValueError) as exc:
        path = report.write(f"FAILED: {str(exc).splitlines()[0]}")
        print(f"image-test: FAILED: {exc}\nimage-test: report: {path}", file=sys.stderr)
        return 1
    path = report.write("passed")
    print(f"image-test: passed; report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
