"""buf lint and buf breaking on protos/: the API is the contract for every language.

``buf`` comes from the ``@bufbuild/buf`` npm package (root ``package.json``);
``make test`` and ``make lint`` install it before they run. The breaking-change
check compares protos/ with the committed baseline image
(``protos/baseline/leasekeeper-v1.binpb``, ``make protos-baseline``) under the
FILE rules; the tests below show it passes on the real tree and fails on a copy
with a breaking change.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUF = ROOT / "node_modules" / ".bin" / "buf"
PROTO = Path("protos") / "leasekeeper" / "v1" / "lease_service.proto"
BASELINE = Path("protos") / "baseline" / "leasekeeper-v1.binpb"
BUF_TIMEOUT_S = 60


def buf(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run buf in ``cwd``; fails the test (no skip) when buf is not installed."""
    if not BUF.exists():
        pytest.fail("buf is missing: run `make test` (it installs the npm packages) or `npm ci`")
    return subprocess.run(
        [str(BUF), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=BUF_TIMEOUT_S,
        check=False,
    )


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A copy of buf.yaml and protos/ (with the baseline) to break."""
    shutil.copy(ROOT / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    return tmp_path


def complaints(result: subprocess.CompletedProcess[str]) -> set[str]:
    """The rule ids buf reported (run with ``--error-format json``)."""
    lines = (line for line in result.stdout.splitlines() if line.startswith("{"))
    return {json.loads(line)["type"] for line in lines}


def edit(path: Path, pattern: str, replacement: str) -> None:
    """Replace the first match of ``pattern`` in ``path`` (multiline regex)."""
    text = path.read_text()
    changed, count = re.subn(pattern, replacement, text, count=1, flags=re.MULTILINE)
    assert count == 1, f"/{pattern}/ is not in {path}"
    path.write_text(changed)


def append(path: Path, text: str) -> None:
    """Add ``text`` at the end of ``path``."""
    path.write_text(path.read_text() + text)


def test_buf_lint_real_tree_passes():
    result = buf("lint")
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_breaking_real_tree_against_baseline_passes():
    result = buf("breaking", "--against", str(BASELINE))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("pattern", "replacement", "complaint"),
    [
        (r"^(\s+)int64 current_fence = 2;$", r"\1int64 current_fence = 99;", "FIELD_NO_DELETE"),
        (r"^\s+rpc ValidateFence\(.*$", "", "RPC_NO_DELETE"),
        (r"^(\s+)string task_id = 2;$", r"\1string job_id = 2;", "FIELD_SAME_NAME"),
    ],
    ids=["renumbered-field", "removed-rpc", "renamed-field"],
)
def test_buf_breaking_breaking_change_fails(workspace, pattern, replacement, complaint):
    edit(workspace / PROTO, pattern, replacement)
    result = buf("breaking", "--against", str(BASELINE), "--error-format", "json", cwd=workspace)
    assert result.returncode != 0, "buf breaking accepted a breaking change"
    assert complaint in complaints(result), result.stdout + result.stderr


def test_buf_breaking_added_message_passes(workspace):
    append(workspace / PROTO, "\nmessage AddedLater {\n  string note = 1;\n}\n")
    result = buf("breaking", "--against", str(BASELINE), cwd=workspace)
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_lint_camel_case_field_fails(workspace):
    append(workspace / PROTO, "\nmessage LintProbe {\n  string badName = 1;\n}\n")
    result = buf("lint", "--error-format", "json", cwd=workspace)
    assert result.returncode != 0, "buf lint accepted a camelCase field"
    assert complaints(result) == {"FIELD_LOWER_SNAKE_CASE"}, result.stdout + result.stderr
