"""``python -m leasekeeper_server.cli.tokens new|hash``: entries for a token file.

For ``LEASEKEEPER_TOKENS_FILE`` (its format: :mod:`leasekeeper_server.security.tokens`).
``new`` prints a fresh token on stderr, once, and its entry on stdout; ``hash``
reads a token you already have on stdin and prints its entry. The command
lives here, not in ``security/``, so running it imports nothing twice (the
security package loads its token module as it is imported).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from leasekeeper_server.security.tokens import ROLES, file_entry, new_token


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m leasekeeper_server.cli.tokens new|hash``: token file entries."""
    parser = argparse.ArgumentParser(
        prog="python -m leasekeeper_server.cli.tokens",
        description="Make entries for a leasekeeper token file (LEASEKEEPER_TOKENS_FILE).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    new = commands.add_parser("new", help="a fresh token (stderr) and its entry (stdout)")
    hashed = commands.add_parser("hash", help="the entry for a token read from stdin")
    for command in (new, hashed):
        command.add_argument("--name", required=True)
        command.add_argument("--role", required=True, choices=ROLES)
        command.add_argument(
            "--namespace", action="append", required=True, help="a pattern; repeat for more"
        )
    args = parser.parse_args(argv)
    if args.command == "new":
        token = new_token()[1]
        print(f"token (shown once, keep it secret): {token}", file=sys.stderr)
    else:
        token = sys.stdin.read().strip()
        if not token:
            parser.error("no token on stdin")
    try:
        sys.stdout.write(file_entry(token, args.name, args.role, args.namespace))
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
