"""A Griffe extension: the client's reST markup in docstrings, shown as Markdown on the site.

The docstrings are Google style, read in editors and by ``help()``, and name other objects
with Sphinx roles (``:class:`FenceChecker```, ``:meth:`~leasekeeper.HeldLease.metadata```)
and introduce code with ``::``. mkdocstrings renders docstrings as Markdown, where those
would show as written. This extension rewrites them when Griffe loads the package:

- a role becomes the object's name in code, linked to its entry on the site when it has one
  (an *optional* cross-reference: a name the site does not document stays plain code);
- a paragraph ending in ``::`` ends in ``:``, and the indented block after it becomes a
  fenced code block.

mkdocs.yml loads it: ``plugins: mkdocstrings: handlers: python: options: extensions:``.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

PACKAGE = "leasekeeper"
# :role:`name`, :role:`~a.b.name`, :role:`title <a.b.name>`
ROLE = re.compile(
    r":(?:py:)?(?:class|meth|func|mod|data|attr|exc|obj):"
    r"`(?P<short>~?)(?:(?P<title>[^`<]+?)\s*<(?P<target>[\w.]+)>|(?P<name>[\w.]+))(?P<call>\(\))?`"
)
LITERAL_INTRO = re.compile(r"^(?P<text>.*\S)?::$")


def _identifier(name: str, obj: griffe.Object) -> str:
    """The site's identifier for a name in ``obj``'s docstring (an absolute guess)."""
    if name.startswith(PACKAGE + ".") or name == PACKAGE:
        return name
    if obj.is_class and "." not in name:  # :meth:`close` in a class: its own method
        return f"{obj.path}.{name}"
    if obj.parent is not None and obj.parent.is_class and "." not in name:
        return f"{obj.parent.path}.{name}"
    return f"{PACKAGE}.{name}"


def roles_to_references(text: str, obj: griffe.Object) -> str:
    """``:role:`~a.b.C``` as an optional cross-reference titled ``C`` (``a.b.C`` without ~)."""

    def reference(match: re.Match[str]) -> str:
        name = match["target"] or match["name"]
        title = match["title"] or (name.rsplit(".", 1)[-1] if match["short"] else name)
        title += match["call"] or ""
        identifier = _identifier(name, obj)
        return f'<autoref identifier="{identifier}" optional><code>{title}</code></autoref>'

    return ROLE.sub(reference, text)


def literal_blocks(text: str) -> str:
    """``Text::`` and the indented block after it as ``Text:`` and a fenced code block."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        intro = LITERAL_INTRO.match(lines[i].rstrip())
        block_start = i + 1
        while block_start < len(lines) and not lines[block_start].strip():
            block_start += 1
        indent = _indent(lines[i])
        if not intro or block_start == len(lines) or _indent(lines[block_start]) <= indent:
            out.append(lines[i])
            i += 1
            continue
        if intro.group("text"):
            out += [lines[i].rstrip()[:-1], ""]
        end = block_start
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > indent):
            end += 1
        while end > block_start and not lines[end - 1].strip():
            end -= 1
        code = textwrap.indent(textwrap.dedent("\n".join(lines[block_start:end])), " " * indent)
        out += [" " * indent + "```", code, " " * indent + "```"]
        i = end
    return "\n".join(out)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


class SphinxRoles(griffe.Extension):
    """Rewrites reST roles and literal blocks in every docstring of the package."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrites ``obj``'s docstring before it is parsed."""
        if obj.docstring is not None and obj.path.startswith(PACKAGE):
            text = literal_blocks(obj.docstring.value)
            obj.docstring.value = roles_to_references(text, obj)
