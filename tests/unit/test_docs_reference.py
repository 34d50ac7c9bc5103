"""The generated reference pages cover their sources: the proto, the CLI parser, the settings.

scripts/gen_docs_reference.py writes reference/{grpc,cli,settings}.md at every site build;
these tests check that nothing of the source is left off a page, and the last one builds the
whole site strictly (a few seconds), as ``make docs-check`` does.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import leasekeeper

ROOT = Path(__file__).resolve().parents[2]
PYTHON_PAGE = ROOT / "docs" / "reference" / "python.md"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load("gen_docs_reference")


@pytest.fixture(scope="module")
def descriptors():
    return gen.descriptor_set()


@pytest.fixture(scope="module")
def grpc_sections(descriptors) -> dict[str, str]:
    """The gRPC page's sections by heading id (the text up to the next heading)."""
    page = gen.grpc_page(descriptors)
    sections = {}
    for part in re.split(r"\n(?=#{2,3} )", page):
        found = re.match(r"#{2,3} .*?\{ #(?P<id>[\w.]+) \}", part)
        if found:
            sections[found["id"]] = part
    return sections


def _assert_comment_in(comment: str, section: str, what: str) -> None:
    """Every line of the comment is in the section: in prose (escaped) or in a text block."""
    for line in comment.split("\n"):
        text = line.strip()
        if text:
            assert text in section or gen.escape(text) in section, f"{what}: {line!r} missing"


def test_every_rpc_is_on_the_grpc_page_with_its_types_and_comment(descriptors, grpc_sections):
    count = 0
    for file in gen.our_files(descriptors):
        notes = gen.comments(file)
        for s, service in enumerate(file.service):
            for m, method in enumerate(service.method):
                section = grpc_sections[gen.anchor(method.name)]
                for type_name in (method.input_type, method.output_type):
                    assert gen.type_link(type_name, file.package) in section, method.name
                assert ("stream of" in section.split("\n\n")[1]) == (
                    method.client_streaming or method.server_streaming
                ), method.name
                comment = notes.get((gen.SERVICES, s, gen.SERVICE_METHODS, m), "")
                assert comment, f"{method.name} has no comment in the proto"
                _assert_comment_in(comment, section, method.name)
                count += 1
    assert count >= 16


def test_every_message_and_field_is_on_the_grpc_page_with_its_comment(descriptors, grpc_sections):
    count = 0
    for file in gen.our_files(descriptors):
        notes = gen.comments(file)
        for path, name, message in gen.messages(file):
            section = grpc_sections[gen.anchor(name)]
            _assert_comment_in(notes.get(path, ""), section, name)
            for i, field in enumerate(message.field):
                row = f"| `{field.name}` | {field.number} | "
                assert row in section, f"{name}.{field.name} missing"
                note = notes.get((*path, gen.MESSAGE_FIELDS, i), "")
                _assert_comment_in(note, section, f"{name}.{field.name}")
            count += 1
    assert count >= 30


def test_every_enum_and_value_is_on_the_grpc_page_with_its_comment(descriptors, grpc_sections):
    count = 0
    for file in gen.our_files(descriptors):
        notes = gen.comments(file)
        for path, name, enum in gen.enums(file):
            section = grpc_sections[gen.anchor(name)]
            _assert_comment_in(notes.get(path, ""), section, name)
            for i, value in enumerate(enum.value):
                assert f"| `{value.name}` | {value.number} | " in section, value.name
                note = notes.get((*path, gen.ENUM_VALUES, i), "")
                _assert_comment_in(note, section, value.name)
            count += 1
    assert count >= 7


def test_the_grpc_page_links_only_to_its_own_headings(descriptors):
    page = gen.grpc_page(descriptors)
    ids = set(re.findall(r"\{ #([\w.]+) \}", page))
    links = set(re.findall(r"\]\(#([\w.]+)\)", page))
    assert links, "no type is linked"
    assert links <= ids, f"links to missing headings: {sorted(links - ids)}"


def test_the_files_overview_is_on_the_grpc_page(descriptors):
    page = gen.grpc_page(descriptors)
    for file in gen.our_files(descriptors):
        overview = gen.comments(file).get((gen.SYNTAX,), "")
        assert overview, f"{file.name} has no overview comment above its syntax line"
        _assert_comment_in(overview, page, file.name)


def test_an_indented_comment_block_keeps_its_columns():
    comment = "Errors:\n  ABORTED  LEASE_EXPIRED,\n           LEASE_REVOKED.\nClaim again."
    assert gen.comment_markdown(comment) == (
        "Errors:\n\n```text\nABORTED  LEASE_EXPIRED,\n         LEASE_REVOKED.\n```\n\nClaim again."
    )
    assert gen.comment_cell(comment) == (
        "Errors:<br>ABORTED  LEASE_EXPIRED, LEASE_REVOKED.<br>Claim again."
    )


def _cli_commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command of the parser, walked here independently of the generator."""
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _cli_commands(sub, (*path, name))
    return found


def _words(text: str) -> str:
    return " ".join(text.split())


def test_every_cli_command_is_on_the_cli_page_with_its_help():
    parser = gen.cli_parser()
    page = gen.cli_page(parser)
    sections = {
        part.split("\n", 1)[0].lstrip("# "): part for part in re.split(r"\n(?=#{2,4} )", page)
    }
    commands = _cli_commands(parser)
    assert len(commands) >= 15
    for path, command in commands:
        title = " ".join((parser.prog, *path))
        assert title in sections, f"{title} has no section"
        section = _words(sections[title])
        assert f"usage: {title}" in section, title
        for text in (command.description, command.epilog):
            if text:
                assert _words(text.replace("%(prog)s", command.prog)) in section, title
        for action in command._actions:
            for option in action.option_strings:
                assert option in section, f"{title} {option}"


def test_the_cli_page_does_not_depend_on_the_environment(monkeypatch):
    page = gen.cli_page(gen.cli_parser())
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("LEASEKEEPER_TOKEN", "a-secret-token")
    monkeypatch.setenv("LEASEKEEPER_TARGET", "elsewhere:1")
    again = gen.cli_page(gen.cli_parser())
    assert again == page
    assert "a-secret-token" not in again
    assert os.environ["LEASEKEEPER_TOKEN"] == "a-secret-token"  # restored after generating


def test_every_setting_is_on_the_settings_page():
    settings = gen.settings_class()
    page = gen.settings_page(settings)
    for name, field in settings.model_fields.items():
        assert field.description, f"setting {name} has no description"
        row = next(
            (
                line
                for line in page.split("\n")
                if line.startswith(f"| `LEASEKEEPER_{name.upper()}` |")
            ),
            None,
        )
        assert row is not None, f"LEASEKEEPER_{name.upper()} missing from the settings page"
        assert row.count(" | ") >= 3, row
    assert "the user's data directory + `/leasekeeper/pgdata`" in page  # default_data_dir


def test_every_public_name_of_the_client_is_on_the_python_page():
    directives = re.findall(r"^::: ([\w.]+)$", PYTHON_PAGE.read_text("utf-8"), re.MULTILINE)
    modules = [importlib.import_module(d) for d in directives if _is_module(d)]
    missing = [
        name
        for name in leasekeeper.__all__
        if f"leasekeeper.{name}" not in directives
        and not any(name in vars(module) for module in modules if module is not leasekeeper)
    ]
    assert not missing, f"public names missing from docs/reference/python.md: {missing}"
    for directive in directives:
        module_name, _, attribute = directive.rpartition(".")
        if not _is_module(directive):
            assert hasattr(importlib.import_module(module_name), attribute), directive


def _is_module(dotted: str) -> bool:
    try:
        importlib.import_module(dotted)
    except ImportError:
        return False
    return True


def test_the_sphinx_markup_of_docstrings_becomes_markdown():
    roles = _load("griffe_sphinx_roles")
    import griffe

    module = griffe.Module("fencing", parent=griffe.Module("leasekeeper"))
    text = "Check with :class:`FenceChecker` or :meth:`~leasekeeper.HeldLease.metadata`::"
    text += "\n\n    checker = FenceChecker(client)\n\n      await checker.check(ref)\n\nDone."
    assert roles.roles_to_references(roles.literal_blocks(text), module) == (
        'Check with <autoref identifier="leasekeeper.FenceChecker" optional>'
        "<code>FenceChecker</code></autoref> or "
        '<autoref identifier="leasekeeper.HeldLease.metadata" optional>'
        "<code>metadata</code></autoref>:\n\n"
        "```\nchecker = FenceChecker(client)\n\n  await checker.check(ref)\n```\n\nDone."
    )


def test_the_site_builds_strictly(tmp_path):
    """The whole site, as ``make docs-check`` builds it (about 4 s): links, anchors, API."""
    env = dict(os.environ, DISABLE_MKDOCS_2_WARNING="true", NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    warnings = [line for line in done.stderr.splitlines() if "WARNING" in line]
    assert done.returncode == 0, "\n".join(warnings) or done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "grpc" / "index.html").exists()
