"""ARCHITECTURE.md maps every module: a module added or renamed without the map fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (ROOT / "server" / "leasekeeper_server", ROOT / "client" / "leasekeeper")


def test_every_module_is_named_in_the_architecture_map() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    missing = [
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in sorted(package.rglob("*.py"))
        if path.stem != "__init__" and "v1" not in path.parts and path.stem not in words
    ]
    assert not missing, f"ARCHITECTURE.md does not name: {missing}"


def test_every_server_folder_is_named_in_the_architecture_map() -> None:
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    folders = [p.name for p in PACKAGES[0].iterdir() if (p / "__init__.py").exists()]
    assert folders
    assert [f for f in folders if f"{f}/" not in text] == []


def _imports(folder: str) -> dict[str, set[str]]:
    """Each module of a server folder: the leasekeeper_server modules it imports (any level)."""
    found: dict[str, set[str]] = {}
    for path in sorted((PACKAGES[0] / folder).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "leasekeeper_server"
            ):
                names.add(str(node.module))
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names if a.name.startswith("leasekeeper_server"))
        found[path.name] = names
    return found


def test_the_domain_imports_no_other_layer() -> None:
    outside = {
        module: sorted(n for n in names if not n.startswith("leasekeeper_server.core"))
        for module, names in _imports("core").items()
    }
    assert {m: n for m, n in outside.items() if n} == {}


def test_the_rpc_layer_reaches_storage_only_through_its_protocol() -> None:
    storage = {
        module: sorted(
            n
            for n in names
            if n.startswith("leasekeeper_server.storage")
            and not n.startswith("leasekeeper_server.storage.protocol")
            and n != "leasekeeper_server.storage"
        )
        for module, names in _imports("rpc").items()
    }
    assert {m: n for m, n in storage.items() if n} == {}
