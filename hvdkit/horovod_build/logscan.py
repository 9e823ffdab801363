"""Find the first real error in a multi-thousand-line build log (pure)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hvdkit.horovod_build.remedies import KnownFailure, first_known_failure

_ERROR = re.compile(
    r"(: (fatal )?error:|^\s*#error|CMake Error|error: command .* failed|"
    r"Killed signal terminated|(ModuleNotFoundError|ImportError): No module named|"
    r"No matching distribution)"
)
# Lines that contain "error" but are not errors: flags, file names, and warnings (torch's
# "UserWarning: Failed to initialize NumPy: No module named 'numpy'" among them).
_NOT_ERROR = re.compile(
    r"(-Werror|-Wno-error|error\.cc|error\.h\b|errors in the future|[Ww]arning:)"
)


@dataclass(frozen=True)
class FirstError:
    """The first error line, a few lines around it, and the known failure it matches."""

    line_number: int
    context: list[str]
    known: KnownFailure | None


def first_error(lines: list[str], context: int = 3) -> FirstError | None:
    """The first error that matches a known failure, else the first line that looks like a
    compiler, CMake or pip error; with context. A known failure wins because the first
    error line is often only a consequence (a make rule failing, a module missing)."""
    first: FirstError | None = None
    for i, line in enumerate(lines):
        if _ERROR.search(line) and not _NOT_ERROR.search(line):
            window = lines[max(0, i - 1) : i + context]
            known = next((k for k in map(first_known_failure, window) if k), None)
            found = FirstError(line_number=i + 1, context=[w.rstrip() for w in window], known=known)
            if known is not None:
                return found
            first = first or found
    return first


def summarize_failure(lines: list[str], log_path: str) -> str:
    """The message a failed build prints: first error, the known fix, the full log's path."""
    found = first_error(lines)
    out = ["Horovod build failed."]
    if found is None:
        out += ["No compiler error was recognised; the last lines were:"]
        out += ["  " + line.rstrip() for line in lines[-15:]]
    else:
        out += [f"First error (log line {found.line_number}):"]
        out += ["  " + line for line in found.context]
        if found.known is not None:
            out += [f"Known problem: {found.known.cause}.", f"Fix: {found.known.fix}."]
    out += [f"Full log: {log_path}"]
    return "\n".join(out)
