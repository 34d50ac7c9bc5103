"""Every fenced block of the README and of ``docs/`` is run, checked, or marked a fragment.

A fenced block's language says what the test suite does with it (Sybil collects the blocks
from the Markdown; ``conftest.py`` at the project's root wires it to pytest):

- ``python``: written to a file and run with this interpreter in a process of its own, as a
  user would run it; it must exit 0.
- ``sh`` or ``bash``: run by ``bash -e -o pipefail``; it must exit 0.
- ``js``: written to a ``.mjs`` file beside ``examples/node``'s packages and run by ``node``.
- ``output``: what the block right before it prints. It is compared with that block's
  standard output, line by line after stripping trailing spaces; ``...`` stands for any text
  (several lines included), as in doctest's ELLIPSIS.
- ``toml``, ``yaml``, ``json``: parsed; a syntax error fails.
- ``text`` and ``mermaid``: pictures and sample output of long-running commands; not code.

Any other block, and any block that must not run (it starts a service that runs until
stopped, or it is one part of a larger program), is preceded by a marker saying why::

    <!-- fragment: the reason it is not run on its own -->

A fragment in ``python``, ``sh`` or ``js`` is still checked for syntax.

Snippets run against a real ``leasekeeper serve`` (see ``service.py``): its address is in
``LEASEKEEPER_TARGET``, which the client and the ``leasekeeper`` command read when no
address is given; its database is in ``LEASEKEEPER_DATABASE_URL`` and its metrics address
in ``LEASEKEEPER_METRICS_LISTEN``. Each document starts from an empty database; its blocks
run in order, in one working folder (the project's root for the README, a temporary folder
for a page of ``docs/``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml
from sybil import Document, Example, Region
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "examples" / "node"
RUN_TIMEOUT_S = 120.0

RUN = {"python", "sh", "bash", "js"}
PARSE = {"toml", "yaml", "json"}
NOT_CODE = {"text", "mermaid"}
OUTPUT = "output"

_INFO = re.compile(r"(?P<info>[^\n]*)$\n", re.MULTILINE)
_FRAGMENT = re.compile(r"<!--\s*fragment:\s*(?P<reason>(?:(?!-->).)*?)\s*-->\s*$", re.S)


@dataclass
class Block:
    """One fenced block: its language, source and what surrounds it."""

    language: str
    source: str
    line: int
    fragment: str | None
    output: str | None = None


class DocumentBlocks:
    """A Sybil parser yielding one region per fenced block (the module docstring's rules)."""

    def __call__(self, document: Document) -> Iterable[Region]:
        regions = list(RawFencedCodeBlockLexer(info_pattern=_INFO)(document))
        consumed: set[int] = set()
        for index, region in enumerate(regions):
            if index in consumed:
                continue
            info = str(region.lexemes["info"]).strip()
            language = info.split()[0] if info else ""
            before = document.text[: region.start]
            marker = _FRAGMENT.search(before[-600:])
            block = Block(
                language=language,
                source=str(region.lexemes["source"]),
                line=document.text.count("\n", 0, region.start) + 1,
                fragment=marker.group("reason") if marker else None,
            )
            end = region.end
            following = regions[index + 1] if index + 1 < len(regions) else None
            if following is not None and _language(following) == OUTPUT:
                between = document.text[region.end : following.start]
                if not between.strip():
                    block.output = str(following.lexemes["source"])
                    consumed.add(index + 1)
                    end = following.end
            yield Region(region.start, end, block, evaluate)


def _language(region: Region) -> str:
    info = str(region.lexemes["info"]).strip()
    return info.split()[0] if info else ""


def evaluate(example: Example) -> str | None:
    """Runs, parses or checks one block; a returned string is a failure message."""
    block: Block = example.parsed
    where = f"{Path(example.path).name}, line {block.line}"
    if block.fragment is not None:
        if not block.fragment:
            return f"{where}: a fragment marker needs its reason"
        return _check_syntax(block, where)
    if block.language == OUTPUT:
        return f"{where}: an output block must follow the block whose output it shows"
    if block.language in NOT_CODE:
        return None
    if block.language in PARSE:
        return _parse(block, where)
    if block.language not in RUN:
        return (
            f"{where}: a ```{block.language or '(no language)'} block is neither run nor "
            "parsed; mark it <!-- fragment: reason --> or use a language tests/docs/blocks.py runs"
        )
    workdir, env = _prepare(example)
    result = _run(block, workdir, env)
    if result.returncode != 0:
        return (
            f"{where}: the ```{block.language} block exited {result.returncode}\n"
            f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
        )
    if block.output is not None and not _matches(block.output, result.stdout):
        return (
            f"{where}: the ```{block.language} block's output differs from the output block\n"
            f"--- expected\n{block.output}\n--- printed\n{result.stdout}"
        )
    return None


def _prepare(example: Example) -> tuple[Path, dict[str, str]]:
    """The document's working folder and environment; the first time, empties the database."""
    namespace = example.namespace
    if "env" not in namespace:
        service = namespace["docs"]
        service.reset()
        path = Path(example.path)
        if path == ROOT / "README.md":
            namespace["workdir"] = ROOT
        else:
            namespace["workdir"] = Path(tempfile.mkdtemp(prefix=f"docs-{path.stem}-"))
        namespace["env"] = snippet_env(service.target, service.database_url, service.metrics_listen)
    return namespace["workdir"], namespace["env"]


def _run(block: Block, workdir: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    if block.language == "python":
        script = Path(tempfile.mkdtemp(prefix="docs-snippet-")) / f"snippet_{block.line}.py"
        script.write_text(block.source)
        command = [sys.executable, str(script)]
        cwd = workdir
    elif block.language == "js":
        folder = NODE_DIR / ".docs-snippets"
        folder.mkdir(exist_ok=True)
        script = folder / f"snippet_{uuid.uuid4().hex[:8]}.mjs"
        script.write_text(block.source)
        command = ["node", str(script)]
        cwd = workdir
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", block.source]
        cwd = workdir
    try:
        return subprocess.run(
            command,
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    finally:
        if block.language == "js":
            script.unlink(missing_ok=True)


def _check_syntax(block: Block, where: str) -> str | None:
    if block.language == "python":
        try:
            compile(block.source, where, "exec", flags=0, dont_inherit=True)
        except SyntaxError as exc:
            return f"{where}: the python fragment does not parse: {exc}"
    elif block.language in ("sh", "bash"):
        checked = subprocess.run(
            ["bash", "-n", "-c", block.source], capture_output=True, text=True, check=False
        )
        if checked.returncode != 0:
            return f"{where}: the sh fragment does not parse: {checked.stderr}"
    elif block.language == "js":
        checked = subprocess.run(
            ["node", "--check", "--input-type=module"],
            input=block.source,
            capture_output=True,
            text=True,
            check=False,
        )
        if checked.returncode != 0:
            return f"{where}: the js fragment does not parse: {checked.stderr}"
    elif block.language in PARSE:
        return _parse(block, where)
    return None


def _parse(block: Block, where: str) -> str | None:
    try:
        if block.language == "toml":
            tomllib.loads(block.source)
        elif block.language == "yaml":
            list(yaml.safe_load_all(block.source))
        else:
            json.loads(block.source)
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as exc:
        return f"{where}: the ```{block.language} block does not parse: {exc}"
    return None


def _matches(expected: str, printed: str) -> bool:
    """``printed`` matches ``expected``, where ``...`` stands for any text."""

    def lines(text: str) -> str:
        return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())

    pattern = ".*?".join(re.escape(part) for part in lines(expected).split("..."))
    return re.fullmatch(pattern, lines(printed), re.S) is not None


def snippet_env(target: str, database_url: str, metrics_listen: str) -> dict[str, str]:
    """The environment a snippet runs in: this one, the venv first on PATH, the service's
    address, database and metrics address."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEKEEPER_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["LEASEKEEPER_TARGET"] = target
    env["LEASEKEEPER_DATABASE_URL"] = database_url
    env["LEASEKEEPER_METRICS_LISTEN"] = metrics_listen
    env["PYTHONUNBUFFERED"] = "1"
    return env
