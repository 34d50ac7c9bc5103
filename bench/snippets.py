"""Named sections of a generated Markdown file, for the docs to include.

The docs include a published result's tables with pymdownx.snippets
(``--8<-- "bench/published/results.md:targets"``), so each figure is written once:
in the file the bench generated from its JSON.
"""

from __future__ import annotations


def section(name: str, lines: list[str]) -> list[str]:
    """``lines`` between the start and end markers of section ``name``, then a blank line.

    Blank lines at either end are dropped; no lines give no section at all.
    """
    start, end = 0, len(lines)
    while start < end and not lines[start]:
        start += 1
    while end > start and not lines[end - 1]:
        end -= 1
    if start == end:
        return []
    return [
        f"<!-- --8<-- [start:{name}] -->",
        *lines[start:end],
        f"<!-- --8<-- [end:{name}] -->",
        "",
    ]
