"""MkDocs hooks of hvdkit's docs site (mkdocs.yml, ``hooks:``).

``<!-- hvdkit-help: COMMAND -->`` on a line of its own becomes that command's ``--help``, as
the installed hvdkit prints it, so the CLI reference cannot drift from the parser.
"""

from __future__ import annotations

import os
import re
from typing import Any

HELP = re.compile(r"^<!-- hvdkit-help: ([\w-]*) -->$", re.MULTILINE)
WIDTH = "88"  # fits the page's code column at 1280 pixels


def command_help(command: str) -> str:
    """``hvdkit COMMAND --help`` (``hvdkit --help`` for an empty COMMAND), 88 columns wide."""
    from hvdkit.cli import build_parser

    os.environ["COLUMNS"] = WIDTH  # argparse wraps to the terminal; the page must not vary
    parser = build_parser()
    if not command:
        return parser.format_help()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    if command not in subparsers.choices:
        raise ValueError(f"<!-- hvdkit-help: {command} -->: hvdkit has no command {command!r}")
    return subparsers.choices[command].format_help()


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return HELP.sub(lambda m: f"```text\n{command_help(m.group(1)).rstrip()}\n```", markdown)
