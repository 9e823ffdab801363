"""What ``hvdkit run`` prints: horovodrun's tagged output turned into whole lines. Pure.

horovodrun passes each rank's output on in pieces, each with a tag: ``[3]<stdout>:`` under
Gloo (a piece per line, and per ``\\r`` of a progress bar), ``[1,3]<stdout>:`` under MPI's
``--tag-output`` (a piece per write, so ``print`` can come as the text and then its newline,
with another rank's piece in between). Printed as they come, lines break in the middle
(``test loss: 0.1259[1,0]<stdout>:``) and progress bars smear into one long line.

:class:`Demux` reassembles each rank's stream into whole lines (and progress updates, the
pieces that end in ``\\r``); :func:`render` gives each line the one prefix format, as torchrun
and Accelerate users expect: rank 0's stdout as it is, every other line ``[rank N] ...``.
Framework start-up noise (TensorFlow's C++ logging before absl is initialised, which
``TF_CPP_MIN_LOG_LEVEL`` does not silence) is dropped unless ``--verbose``; warnings and
errors of the program itself are never dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TAG = re.compile(r"\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:")
# What only a terminal shows right: colours and cursor moves (CSI sequences), backspaces.
TERMINAL_ONLY = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x08")

# Lines TensorFlow's C++ runtime prints at import, whatever TF_CPP_MIN_LOG_LEVEL says: info
# lines of absl's pre-init logging, and the benign warnings/errors of a CPU-only machine.
NOISE = [
    re.compile(p)
    for p in (
        r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to "
        r"STDERR$",
        r"^I\d{4} [\d:.]+ +\d+ [\w/.-]+\.cc:\d+\] ",
        r"^To enable the following instructions: .* in other operations, rebuild TensorFlow "
        r"with the appropriate compiler flags\.$",
        r"^[EW]\d{4} [\d:.]+ +\d+ \w+\.cc:\d+\] Unable to register cu(DNN|FFT|BLAS) factory",
    )
]
# Errors only on a machine without a GPU, where they say nothing (on a GPU machine they are real).
NO_GPU_NOISE = [
    re.compile(p)
    for p in (
        r"^[EW]\d{4} [\d:.]+ +\d+ \w+\.cc:\d+\] failed call to cuInit: ",
        r"^W\d{4} [\d:.]+ +\d+ gpu_device\.cc:\d+\] Cannot dlopen some GPU libraries",
    )
]


def is_noise(text: str, gpu: bool = False) -> bool:
    """Whether ``text`` (one line, no tag) is framework start-up noise; ``gpu``: the machine
    has a GPU, so CUDA initialisation errors are kept."""
    return any(p.search(text) for p in NOISE) or (
        not gpu and any(p.search(text) for p in NO_GPU_NOISE)
    )


@dataclass(frozen=True)
class Piece:
    """A whole line (``progress`` False) or a progress update (text before a ``\\r``) of one
    rank's stream; ``rank`` None is horovodrun's own output."""

    rank: int | None
    stream: str
    text: str
    progress: bool = False


class Demux:
    """Reassembles horovodrun's tagged output into whole lines per rank and stream."""

    def __init__(self) -> None:
        self._partial: dict[tuple[int, str], str] = {}
        # The rank piece a chunk ended inside: horovodrun's output is read line by line, and
        # a line also ends at "\r", so under MPI (a tag per write) the rest of a progress
        # bar's write ("\rbar") starts the next chunk, before any tag.
        self._open: dict[str, tuple[int, str] | None] = {}

    def feed(self, chunk: str, stream: str) -> list[Piece]:
        """Pieces completed by ``chunk`` (what horovodrun wrote to its ``stream``)."""
        out: list[Piece] = []
        matches = list(TAG.finditer(chunk))
        head = chunk[: matches[0].start()] if matches else chunk
        open_key = self._open.get(stream)
        if head and open_key is not None:
            out.extend(self._add(open_key, head))
        elif head:
            # Untagged: horovodrun's own text (whole lines as it writes them).
            for line in head.splitlines():
                out.append(Piece(None, stream, line))
        for i, match in enumerate(matches):
            end = matches[i + 1].start() if i + 1 < len(matches) else len(chunk)
            open_key = (int(match.group(1)), match.group(2))
            out.extend(self._add(open_key, chunk[match.end() : end]))
        self._open[stream] = None if chunk.endswith("\n") else open_key
        return out

    def _add(self, key: tuple[int, str], text: str) -> list[Piece]:
        buffer = self._partial.pop(key, "") + text
        out = []
        while True:
            cut = min((i for i in (buffer.find("\n"), buffer.find("\r")) if i >= 0), default=-1)
            if cut < 0:
                break
            line, sep, buffer = buffer[:cut], buffer[cut], buffer[cut + 1 :]
            if sep == "\r" and buffer.startswith("\n"):  # \r\n ends a line
                sep, buffer = "\n", buffer[1:]
            out.append(Piece(key[0], key[1], line, progress=sep == "\r"))
        if buffer:
            self._partial[key] = buffer
        return out

    def flush(self) -> list[Piece]:
        """What is left without a line end (the job has ended)."""
        out = [Piece(rank, stream, text) for (rank, stream), text in sorted(self._partial.items())]
        self._partial.clear()
        return out


def render(piece: Piece, terminal: bool = True) -> str:
    """The line as shown: rank 0's stdout and horovodrun's own text unprefixed, every other
    rank's line and every stderr line of a rank prefixed ``[rank N] ``. Not on a ``terminal``
    (a log, a pipe) without colours and backspaces: a progress bar that draws them whatever
    its output is (Keras's, on any POSIX system) leaves none in the log."""
    text = piece.text if terminal else TERMINAL_ONLY.sub("", piece.text)
    if piece.rank is None or (piece.rank == 0 and piece.stream == "stdout"):
        return text
    return f"[rank {piece.rank}] {text}"
