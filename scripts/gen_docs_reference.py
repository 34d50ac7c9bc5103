"""Generates the reference pages of the site from the sources, so they cannot drift.

mkdocs-gen-files runs this script at every build (mkdocs.yml, plugin ``gen-files``):

- ``reference/grpc.md``: the gRPC API, from the comments of ``protos/leasekeeper/v1/*.proto``.
  ``grpc_tools.protoc`` compiles them with their source info into a FileDescriptorSet,
  which ``protobuf`` reads. No maintained Python package renders a FileDescriptorSet
  (protoc-gen-doc is a Go binary, not installable with pip), hence the small renderer here.
- ``reference/cli.md``: the ``leasekeeper`` command, from its own argparse parser: every
  command's ``--help``, at a fixed width of 100 columns.
- ``reference/settings.md``: the server's settings, from the pydantic-settings class.

``python scripts/gen_docs_reference.py OUT_DIR`` writes the three pages into OUT_DIR, to
read them without a build. tests/unit/test_docs_reference.py checks that each page covers
its source.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
import textwrap
import types
import typing
from collections import Counter
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from google.protobuf import descriptor_pb2

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"
PROTOS = sorted(PROTO_ROOT.glob("leasekeeper/v1/*.proto"))
HELP_COLUMNS = "100"
CODE_SPAN = re.compile(r"(`[^`\n]*`)")
# A name with an underscore, not inside a code span: maybe a setting (lock_timeout_s).
SETTING_NAME = re.compile(r"(?<![`\w.])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![`\w])")

Descriptor = descriptor_pb2.DescriptorProto
EnumDescriptor = descriptor_pb2.EnumDescriptorProto
FileDescriptor = descriptor_pb2.FileDescriptorProto
Field = descriptor_pb2.FieldDescriptorProto
Method = descriptor_pb2.MethodDescriptorProto
Comments = dict[tuple[int, ...], str]

# Where protoc's source info places a file's parts (descriptor.proto's field numbers).
SYNTAX, MESSAGES, ENUMS, SERVICES = 12, 4, 5, 6
MESSAGE_FIELDS, MESSAGE_NESTED, MESSAGE_ENUMS = 2, 3, 4
ENUM_VALUES, SERVICE_METHODS = 2, 2


# --- gRPC API --------------------------------------------------------------------------------


def descriptor_set() -> descriptor_pb2.FileDescriptorSet:
    """The protos compiled by protoc, with their comments (source info) and their imports."""
    from grpc_tools import protoc

    include = str(resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "descriptors.binpb"
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            "--include_source_info",
            "--include_imports",
            f"--descriptor_set_out={out}",
            *(str(p.relative_to(PROTO_ROOT)) for p in PROTOS),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on " + ", ".join(map(str, PROTOS)))
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def our_files(descriptors: descriptor_pb2.FileDescriptorSet) -> list[FileDescriptor]:
    """The files compiled from protos/ (not the well-known types they import)."""
    names = {str(p.relative_to(PROTO_ROOT)) for p in PROTOS}
    return [f for f in descriptors.file if f.name in names]


def comments(file: FileDescriptor) -> Comments:
    """Each commented element's comment, by its source-info path ('//' and one space removed)."""
    found = {}
    for location in file.source_code_info.location:
        text = location.leading_comments or location.trailing_comments
        if text.strip():
            lines = [line.removeprefix(" ") for line in text.rstrip().split("\n")]
            found[tuple(location.path)] = "\n".join(lines).strip("\n")
    return found


def messages(file: FileDescriptor) -> Iterator[tuple[tuple[int, ...], str, Descriptor]]:
    """Every message of the file, nested ones included: (source path, full name, descriptor)."""

    def walk(path: tuple[int, ...], prefix: str, message: Descriptor) -> Iterator[Any]:
        yield path, prefix + message.name, message
        for i, nested in enumerate(message.nested_type):
            if not nested.options.map_entry:
                yield from walk((*path, MESSAGE_NESTED, i), prefix + message.name + ".", nested)

    for i, message in enumerate(file.message_type):
        yield from walk((MESSAGES, i), "", message)


def enums(file: FileDescriptor) -> Iterator[tuple[tuple[int, ...], str, EnumDescriptor]]:
    """Every enum of the file, nested in messages or not: (source path, full name, descriptor)."""
    for i, enum in enumerate(file.enum_type):
        yield (ENUMS, i), enum.name, enum
    for path, name, message in messages(file):
        for i, enum in enumerate(message.enum_type):
            yield (*path, MESSAGE_ENUMS, i), f"{name}.{enum.name}", enum


def anchor(name: str) -> str:
    """The heading id of a message, enum or RPC: its name in lower case (dots kept)."""
    return name.lower()


def escape(text: str) -> str:
    """Text that Markdown shows as written: no raw HTML, no quote at a line's start.

    Code spans are left alone (Markdown shows their text as it is).
    """
    parts = CODE_SPAN.split(text)
    for i in range(0, len(parts), 2):  # the text between code spans
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;")
    lines = "".join(parts).split("\n")
    return "\n".join("\\" + line if line.startswith(">") else line for line in lines)


def comment_markdown(comment: str) -> str:
    """A comment as Markdown: prose and bullets as they are, indented lines as a text block.

    The protos indent what must keep its columns: the status codes under "Errors:", a
    table of decisions, the roles of tokens.
    """
    out: list[str] = []
    indented: list[str] = []
    in_bullet = False
    for line in comment.split("\n"):
        if line.startswith("  ") and not in_bullet:
            indented.append(line)
            continue
        if indented:
            out += ["", "```text", textwrap.dedent("\n".join(indented)), "```", ""]
            indented = []
        in_bullet = line.startswith("* ") or (in_bullet and line.startswith("  "))
        out.append(escape(line))
    if indented:
        out += ["", "```text", textwrap.dedent("\n".join(indented)), "```"]
    return "\n".join(out).strip("\n")


def comment_cell(comment: str) -> str:
    """A comment on one line, for a table cell: paragraphs and indented entries on new lines."""
    rows: list[str] = []
    base = 0  # within an indented list: the indent of its entries; in prose: 0
    for line in comment.split("\n"):
        indent = len(line) - len(line.lstrip())
        prose_goes_on = indent == 0 and base == 0
        entry_goes_on = indent > base > 0
        joins = bool(rows and rows[-1] and line.strip()) and (prose_goes_on or entry_goes_on)
        base = (base or indent) if indent else 0
        text = escape(line.strip()).replace("|", "\\|")
        if joins:
            rows[-1] += " " + text
        else:
            rows.append(text)
    return re.sub(r"(<br>){3,}", "<br><br>", "<br>".join(rows)) or " "


def type_link(type_name: str, package: str) -> str:
    """A message or enum type as Markdown: a link to its heading when it is one of ours."""
    name = type_name.lstrip(".")
    if name.startswith(package + "."):
        short = name.removeprefix(package + ".")
        return f"[`{short}`](#{anchor(short)})"
    return f"`{name}`"


def field_type(field: Field, package: str) -> str:
    """A field's type: a scalar's proto name, or a link to its message or enum."""
    if field.type in (Field.TYPE_MESSAGE, Field.TYPE_ENUM):
        return type_link(field.type_name, package)
    return f"`{Field.Type.Name(field.type).removeprefix('TYPE_').lower()}`"


def field_label(field: Field) -> str:
    """``repeated``, ``optional`` (proto3's explicit presence), or nothing."""
    if field.label == Field.LABEL_REPEATED:
        return "repeated "
    return "optional " if field.proto3_optional else ""


def render_rpc(path: tuple[int, ...], method: Method, package: str, notes: Comments) -> str:
    """One RPC: heading, request and response types (streams said), its comment."""
    request = type_link(method.input_type, package)
    response = type_link(method.output_type, package)
    if method.client_streaming:
        request = "stream of " + request
    if method.server_streaming:
        response = "stream of " + response
    return "\n\n".join(
        [
            f"### {method.name} {{ #{anchor(method.name)} }}",
            f"Request: {request}. Response: {response}.",
            comment_markdown(notes.get(path, "")),
        ]
    ).rstrip()


def render_message(
    path: tuple[int, ...], name: str, message: Descriptor, file: FileDescriptor
) -> str:
    """One message: heading, comment, and a table of its fields."""
    notes, package = comments(file), file.package
    parts = [f"### {name} {{ #{anchor(name)} }}", comment_markdown(notes.get(path, ""))]
    if message.field:
        rows = ["| Field | Number | Type | Description |", "|---|---|---|---|"]
        for i, field in enumerate(message.field):
            note = comment_cell(notes.get((*path, MESSAGE_FIELDS, i), ""))
            kind = field_label(field) + field_type(field, package)
            rows.append(f"| `{field.name}` | {field.number} | {kind} | {note} |")
        parts.append("\n".join(rows))
    else:
        parts.append("No fields.")
    return "\n\n".join(p for p in parts if p)


def render_enum(
    path: tuple[int, ...], name: str, enum: EnumDescriptor, file: FileDescriptor
) -> str:
    """One enum: heading, comment, and a table of its values."""
    notes = comments(file)
    rows = ["| Value | Number | Description |", "|---|---|---|"]
    for i, value in enumerate(enum.value):
        note = comment_cell(notes.get((*path, ENUM_VALUES, i), ""))
        rows.append(f"| `{value.name}` | {value.number} | {note} |")
    parts = [f"### {name} {{ #{anchor(name)} }}", comment_markdown(notes.get(path, ""))]
    return "\n\n".join(p for p in [*parts, "\n".join(rows)] if p)


def check_anchors(files: list[FileDescriptor]) -> None:
    """Fails when two RPCs, messages or enums would share a heading id."""
    names = [m.name for f in files for s in f.service for m in s.method]
    names += [name for f in files for _, name, _ in messages(f)]
    names += [name for f in files for _, name, _ in enums(f)]
    clashes = sorted(id_ for id_, count in Counter(map(anchor, names)).items() if count > 1)
    if clashes:
        raise ValueError(f"two RPCs, messages or enums share a heading id: {clashes}")


def grpc_page(descriptors: descriptor_pb2.FileDescriptorSet) -> str:
    """The gRPC API page: the files' overviews, the services' RPCs, the messages and enums."""
    files = our_files(descriptors)
    check_anchors(files)
    parts = [
        "# gRPC API",
        "Generated from the comments of "
        + ", ".join(f"`protos/{f.name}`" for f in files)
        + ", the contract for every language. `google.protobuf.Duration` and "
        "`google.protobuf.Timestamp` are Protocol Buffers' well-known types (seconds and "
        "nanoseconds; an instant in UTC). Server reflection is on, so `grpcurl` can list "
        "and describe the service.",
    ]
    for file in files:
        overview = comments(file).get((SYNTAX,), "")
        parts += [f"## Overview: `{file.name}`", f"Package `{file.package}`."]
        parts.append(comment_markdown(overview))
    for file in files:
        notes = comments(file)
        for s, service in enumerate(file.service):
            parts += [f"## Service {service.name}", comment_markdown(notes.get((SERVICES, s), ""))]
            for m, method in enumerate(service.method):
                path = (SERVICES, s, SERVICE_METHODS, m)
                parts.append(render_rpc(path, method, file.package, notes))
    parts.append("## Messages")
    for file in files:
        parts += [render_message(path, name, m, file) for path, name, m in messages(file)]
    parts.append("## Enums")
    for file in files:
        parts += [render_enum(path, name, e, file) for path, name, e in enums(file)]
    return "\n\n".join(p for p in parts if p) + "\n"


# --- Command line ----------------------------------------------------------------------------


@contextlib.contextmanager
def stable_environment() -> Iterator[None]:
    """Help at a fixed width, free of the environment's LEASEKEEPER_* values (a token...)."""
    names = [n for n in os.environ if n.startswith("LEASEKEEPER_")]
    saved = {name: os.environ.pop(name) for name in names}
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        yield
    finally:
        os.environ.update(saved)
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """A parser's subcommands in their order: (name, one-line help, parser); aliases once."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    found.append((name, helps.get(name, ""), sub))
    return found


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = (), summary: str = ""
) -> Iterator[tuple[tuple[str, ...], str, argparse.ArgumentParser]]:
    """Every command, the root first, depth first: (path of names, one-line help, parser)."""
    yield path, summary, parser
    for name, help_text, sub in subcommands(parser):
        yield from commands(sub, (*path, name), help_text)


def cli_parser() -> argparse.ArgumentParser:
    """The ``leasekeeper`` command's parser, as the command builds it (defaults included)."""
    from leasekeeper_server.cli.main import build_parser

    with stable_environment():
        return build_parser()


def cli_page(parser: argparse.ArgumentParser) -> str:
    """The command-line page: each command's help under a heading naming the command."""
    parts = [
        "# Command line",
        f"The `{parser.prog}` command's help, generated from its parser: "
        f"`{parser.prog} COMMAND --help` prints the same. Settings come from "
        "`LEASEKEEPER_*` environment variables ([Settings](settings.md)).",
    ]
    with stable_environment():
        for path, summary, command in commands(parser):
            level = "#" * min(2 + max(len(path) - 1, 0), 4)
            parts.append(f"{level} {' '.join((parser.prog, *path))}")
            if summary:
                parts.append(escape(summary[0].upper() + summary[1:].rstrip(".") + "."))
            parts.append("```text\n" + command.format_help().rstrip() + "\n```")
    return "\n\n".join(parts) + "\n"


# --- Settings --------------------------------------------------------------------------------


def default_data_dir_text() -> str:
    """What ``default_data_dir`` gives, said for every system."""
    return (
        "the user's data directory + `/leasekeeper/pgdata` (Linux: "
        "`~/.local/share/leasekeeper/pgdata`, or under `$XDG_DATA_HOME`; macOS: "
        "`~/Library/Application Support/leasekeeper/pgdata`)"
    )


def factory_defaults() -> dict[Any, str]:
    """How the page says the defaults that a function computes (one entry per factory)."""
    from leasekeeper_server.settings import default_data_dir

    return {default_data_dir: default_data_dir_text()}


def env_name(settings: type, name: str) -> str:
    """The environment variable of a setting: the class's prefix + its name in upper case."""
    return f"{settings.model_config.get('env_prefix', '')}{name}".upper()  # type: ignore[attr-defined]


def one_of(words: list[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    return " or ".join([", ".join(words[:-1]), words[-1]] if len(words) > 2 else words)


def type_text(name: str, annotation: Any) -> str:
    """A setting's type in words: seconds, number, integer, string, path, or its choices."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return one_of([type_text(name, a) for a in kinds])
    if typing.get_origin(annotation) is typing.Literal:
        return one_of([f"`{value}`" for value in typing.get_args(annotation)])
    if annotation is float and name.endswith("_s"):
        return "seconds"
    words = {float: "number", int: "integer", str: "string", bool: "boolean", Path: "path"}
    return words.get(annotation, getattr(annotation, "__name__", str(annotation)))


def bounds_text(field: FieldInfo) -> str:
    """A setting's bounds (pydantic's gt, ge, lt, le) as '> 0, <= 640'."""
    signs = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    found = []
    for constraint in field.metadata:
        for attribute, sign in signs.items():
            value = getattr(constraint, attribute, None)
            if value is not None:
                found.append(f"{sign} {number_text(value)}")
    return ", ".join(found)


def number_text(value: float) -> str:
    """30.0 as 30, 0.002 as 0.002."""
    return str(int(value)) if float(value).is_integer() else str(value)


def in_words(name: str, value: float) -> str:
    """A long duration in days or hours, a size in KiB or MiB: '' when the number says it."""
    if name.endswith("_s") and value >= 3600:
        unit, size = ("day", 86400) if value % 86400 == 0 else ("hour", 3600)
        count = value / size
        return f" ({number_text(count)} {unit}{'s' if count != 1 else ''})"
    if name.endswith("_bytes") and value >= 1024 and value % 1024 == 0:
        mib = value % (1 << 20) == 0
        return f" ({number_text(value / (1 << 20))} MiB)" if mib else f" ({value // 1024} KiB)"
    return ""


def default_text(name: str, field: FieldInfo) -> str:
    """A setting's default as the page says it: the value, 'unset', or the factory's rule."""
    if field.default_factory is not None:
        return factory_defaults()[field.default_factory]  # a new factory needs its words here
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"`{value}`"
    return f"`{number_text(value)}`{in_words(name, value)}"


def description_text(settings: type, text: str) -> str:
    """A description, with the settings it names (e.g. lock_timeout_s) as their variables."""

    def variable(match: re.Match[str]) -> str:
        name = match.group(0)
        known = name in settings.model_fields  # type: ignore[attr-defined]
        return f"`{env_name(settings, name)}`" if known else name

    return escape(SETTING_NAME.sub(variable, text)).replace("|", "\\|")


def settings_class() -> type:
    """The server's settings class."""
    from leasekeeper_server.settings import Settings

    return Settings


def client_variables() -> str:
    """The variables that the client and the command's calls to a server read (not settings)."""
    from leasekeeper.channel import DEFAULT_TARGET, TARGET_ENV, TOKEN_ENV

    return (
        f"Not settings of the server: the Python client and the `leasekeeper` command's calls "
        f"to a server read `{TARGET_ENV}` (the server's address; default `{DEFAULT_TARGET}`) "
        f"and `{TOKEN_ENV}` (the bearer token). See [Command line](cli.md) and "
        "[Python client](python.md)."
    )


def settings_page(settings: type) -> str:
    """The settings page: the class's docstring, and a table of every setting."""
    first, _, rest = (settings.__doc__ or "").partition("\n")
    rows = ["| Variable | Type | Default | Description |", "|---|---|---|---|"]
    for name, field in settings.model_fields.items():  # type: ignore[attr-defined]
        kind = type_text(name, field.annotation)
        limits = bounds_text(field)
        kind += f", {limits}" if limits else ""
        default = default_text(name, field)
        description = description_text(settings, field.description or "")
        rows.append(f"| `{env_name(settings, name)}` | {kind} | {default} | {description} |")
    parts = [
        "# Settings",
        first.strip().replace("``", "`"),
        textwrap.dedent(rest).strip().replace("``", "`"),
        f"Generated from `{settings.__module__}.{settings.__qualname__}`.",
        "\n".join(rows),
        client_variables(),
    ]
    return "\n\n".join(p for p in parts if p) + "\n"


# --- The pages -------------------------------------------------------------------------------


def pages() -> dict[str, str]:
    """Each generated page's text, by its path in the site."""
    return {
        "reference/grpc.md": grpc_page(descriptor_set()),
        "reference/cli.md": cli_page(cli_parser()),
        "reference/settings.md": settings_page(settings_class()),
    }


def write_pages(open_page: Callable[[str, str], IO[str]]) -> None:
    """Writes every page through ``open_page(path, mode)``."""
    for path, text in pages().items():
        with open_page(path, "w") as page:
            page.write(text)


def _open_in(folder: Path) -> Callable[[str, str], IO[str]]:
    def open_page(path: str, mode: str) -> IO[str]:
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        return open(folder / path, mode, encoding="utf-8")

    return open_page


if __name__ == "<run_path>":  # run by mkdocs-gen-files
    import mkdocs_gen_files

    write_pages(mkdocs_gen_files.open)
elif __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/gen_docs_reference.py OUT_DIR")
    write_pages(_open_in(Path(sys.argv[1])))
