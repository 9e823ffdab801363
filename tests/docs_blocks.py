"""The code blocks of the docs (``docs/**/*.md`` and ``README.md``) and what each says about
being run, for tests/test_docs.py. Pure: reading Markdown, no processes.

A block meant to run is preceded by a marker line (an HTML comment, invisible on the site)::

    <!-- test: ID [np=N] [equal=VAR] [ranks=N] [env=NAME=VALUE ...] [timeout=S] [expect=TEXT] -->

``ID`` names the test (``test_docs.py::test_the_docs_code_runs[ID]``). A ``python`` block runs
as a script, in one process or, with ``np=N``, through ``hvdkit run -np N``; ``equal=VAR``
then also checks that every rank ends with the same weights in ``VAR`` (a torch module or a
Keras model). A ``VAR`` that is a list holds one value per rank (what an engine's ``run``
returns: ``ranks=N`` of them), and those must be equal. A ``bash`` block runs in the
repository root. ``expect=TEXT`` (underscores for spaces) must appear in the output. A
``python`` block that is not run says why::

    <!-- not run: a fragment of the script above -->

Every ``hvdkit ...`` and ``make ...`` line of a ``bash`` block is checked either way (the
command parses; the make target exists).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

FENCE = re.compile(r"^(\s*)```(\w*)")
MARKER = re.compile(r"^<!-- (test|not run): (.*) -->$")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# Figures a reader might take as promises: durations, rates, sizes, ratios and accuracies.
FIGURE = re.compile(
    r"\b\d+(?:\.\d+)?\s?(?:s|ms|min|minutes|GB/s|GiB|MB|images/s|samples/s)\b"
    r"|\b[01]\.\d{3,4}x?\b|accuracy (?:of )?0\.\d+"
)
HEADING = re.compile(r"^(#{1,6}) ")
CODE_SPAN = re.compile(r"`[^`]*`")


@dataclass
class Block:
    """One fenced code block of a page."""

    page: str  # relative to the repository root
    line: int  # the fence's line, 1-based
    lang: str
    code: str
    test_id: str | None = None
    options: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    not_run: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse_marker(text: str, where: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """``ID key=value ... env=NAME=VALUE ...`` -> (ID, options, env)."""
    words = text.split()
    if not words or "=" in words[0]:
        raise ValueError(f"{where}: <!-- test: ... --> needs an ID first, got {text!r}")
    options: dict[str, str] = {}
    env: dict[str, str] = {}
    for word in words[1:]:
        key, sep, value = word.partition("=")
        if not sep or key not in ("np", "ranks", "equal", "env", "timeout", "expect"):
            raise ValueError(
                f"{where}: {word!r} in <!-- test: ... --> is not one of np=N, ranks=N, "
                "equal=VAR, env=NAME=VALUE, timeout=S, expect=TEXT"
            )
        if key == "env":
            name, _, val = value.partition("=")
            env[name] = val
        else:
            options[key] = value.replace("_", " ") if key == "expect" else value
    return words[0], options, env


def blocks(text: str, page: str) -> list[Block]:
    """Every fenced block of ``text`` with the marker on the nearest non-blank line above."""
    lines = text.splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, lang = fence.group(1), fence.group(2)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: a code block that is never closed")
        code = "\n".join(line[len(indent) :] for line in lines[i + 1 : end]) + "\n"
        block = Block(page, i + 1, lang, code)
        above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(above)
        if marker and marker.group(1) == "test":
            block.test_id, block.options, block.env = parse_marker(marker.group(2), block.where)
        elif marker:
            block.not_run = marker.group(2)
        found.append(block)
        i = end + 1
    return found


def command_lines(code: str) -> list[list[str]]:
    """The commands of a shell block as argument lists: continuations joined, comments,
    prompts (``$ ``) and variable assignments in front dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        if not line or line.startswith("#"):
            continue
        words = shlex.split(line, comments=True)
        while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
            words = words[1:]
        if words and words[0] == "exec":
            words = words[1:]
        if words:
            commands.append(words)
    return commands


def sections(text: str) -> list[tuple[int, str, str]]:
    """(level, heading, body) of each section of a page (level 0: the text before the first
    heading), a section ending at the next heading of any level. Code blocks are left out: a
    command's ``--timeout 30`` is not a measured figure."""
    out: list[tuple[int, str, list[str]]] = [(0, "(top)", [])]
    in_code = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            in_code = not in_code
            continue
        heading = None if in_code else HEADING.match(line)
        if heading:
            out.append((len(heading.group(1)), line.strip("# ").strip(), []))
        elif not in_code:
            out[-1][2].append(line)
    return [(level, heading, "\n".join(body)) for level, heading, body in out]


def undated_figures(text: str) -> list[str]:
    """Sections that quote a figure (a duration, rate, size, ratio or accuracy) with no date
    saying when it was measured, neither in the section nor in one it is nested in."""
    problems = []
    dated: list[tuple[int, bool]] = []  # the enclosing sections: (level, has a date)
    for level, heading, body in sections(text):
        while dated and dated[-1][0] >= level:
            dated.pop()
        dated.append((level, bool(DATE.search(body))))
        figure = FIGURE.search(CODE_SPAN.sub("", body))  # a message quoted, not a figure
        if figure and not any(has for _, has in dated):
            problems.append(f"section {heading!r} quotes {figure.group(0)!r} with no date")
    return problems


def read_pages(root: Path) -> dict[str, str]:
    """Every Markdown page of the docs, and the README, by path relative to ``root``."""
    paths = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return {str(p.relative_to(root)): p.read_text() for p in paths}
