"""An earlier version's files, for a server of that version measured beside this one.

``source_tree`` lays out the files of one commit of this repository (``git
archive``: that commit's own server, client, migrations and pyproject, none
of the work tree's) in a temporary folder, which
``bench.servers.leasekeeper_server(..., source=folder)`` runs.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


class NoSourceTree(RuntimeError):
    """The revision's files cannot be had (no git, no such commit, a shallow clone)."""


@contextlib.contextmanager
def source_tree(revision: str, repo: Path = REPO_ROOT) -> Iterator[Path]:
    """The files of ``revision`` (a commit of ``repo``, or a folder holding a checkout).

    Yields:
        A folder with the commit's files, removed when the block ends (a
        folder given as ``revision`` is yielded as it is, and kept).

    Raises:
        NoSourceTree: git is missing, or ``repo`` does not have that commit.
    """
    if Path(revision).is_dir():
        yield Path(revision).resolve()
        return
    try:
        archive = subprocess.run(
            ["git", "-C", str(repo), "archive", "--format=tar", f"{revision}^{{commit}}"],
            capture_output=True,
            check=True,
            timeout=120,
        ).stdout
    except FileNotFoundError as exc:
        raise NoSourceTree("git is not installed") from exc
    except subprocess.CalledProcessError as exc:
        said = exc.stderr.decode(errors="replace").strip().splitlines()
        raise NoSourceTree(f"git archive {revision}: {said[-1] if said else exc}") from exc
    with tempfile.TemporaryDirectory(prefix=f"leasekeeper-{revision}-") as folder:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(folder, filter="data")
        yield Path(folder)
