"""The committed stubs must match what protoc makes from protos/ today."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_stubs_match_protos(tmp_path):
    written = _generator().generate(tmp_path)
    assert written, "protoc wrote nothing"
    stale = []
    for fresh in written:
        relative = fresh.relative_to(tmp_path)
        committed = ROOT / "client" / relative
        if not committed.exists() or committed.read_bytes() != fresh.read_bytes():
            stale.append(str(relative))
    assert not stale, f"stubs are stale; run `make protos`: {stale}"
