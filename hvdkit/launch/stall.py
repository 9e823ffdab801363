"""The hang doctor's pure part: Horovod's stall warning read, the ranks' stacks read, and one
line of diagnosis.

Horovod's coordinator (rank 0) warns when a tensor submitted by some ranks waits for the
others longer than ``HOROVOD_STALL_CHECK_TIME_SECONDS``, and lists, per rank, the tensors it
has not submitted. Each rank's Python stacks (``faulthandler``'s format, written by
:mod:`hvdkit.hang`) say where the ranks are. :func:`diagnose` puts the two together: a rank
loading data, waiting on a lock, past its last batch, or in another collective.
"""

from __future__ import annotations

import linecache
import re
from dataclasses import dataclass, field

WARNING = re.compile(r"submitted to be reduced, gathered or broadcasted by subset of ranks")
_HEADER = re.compile(r"^(Stalled|Missing) ranks:\s*$")
_MISSING = re.compile(r"^(\d+)(!?): \[(.*)\]\s*$")
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


@dataclass
class Stall:
    """One stall warning: per rank, the tensors others submitted and it has not (``more``:
    Horovod listed only the first few)."""

    missing: dict[int, list[str]] = field(default_factory=dict)
    more: set[int] = field(default_factory=set)


class WarningReader:
    """Reads rank 0's stderr lines; :attr:`latest` is the last complete stall warning."""

    def __init__(self) -> None:
        self.latest: Stall | None = None
        self._open: Stall | None = None
        self._listing = False

    def feed(self, line: str) -> bool:
        """Take one line; True if it belongs to a stall warning (not to be printed)."""
        if WARNING.search(line):
            self._close()
            self._open, self._listing = Stall(), False
            return True
        if self._open is None:
            return False
        text = line.strip()
        if _HEADER.match(text):
            self._listing = True
            return True
        found = _MISSING.match(text) if self._listing else None
        if found:
            names = [n.strip() for n in found.group(3).split(", ")]
            if names and names[-1].endswith(" ..."):
                names[-1] = names[-1][: -len(" ...")]
                self._open.more.add(int(found.group(1)))
            self._open.missing[int(found.group(1))] = [n for n in names if n]
            return True
        if text.startswith("One or more rank (marked by"):
            return True
        self._close()
        return False

    def _close(self) -> None:
        if self._open is not None and self._open.missing:
            self.latest = self._open
        self._open, self._listing = None, False

    def complete(self) -> Stall | None:
        """The warning being read, as far as it got (its lines come one at a time)."""
        self._close()
        return self.latest


def from_states(waits: dict[int, list[tuple[str, float]]], size: int) -> Stall:
    """The stall the ranks' own notes show (:mod:`hvdkit.hang`: per rank, the collectives it
    has waited in, by name): per rank, the names others wait in that it has not submitted."""
    names = {name for waited in waits.values() for name, _ in waited}
    missing = {}
    for rank in range(size):
        lacking = sorted(names - {name for name, _ in waits.get(rank, [])})
        if lacking:
            missing[rank] = lacking
    return Stall(missing=missing)


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    function: str

    def where(self) -> str:
        return f"{self.path}:{self.line} in {self.function}"

    def source(self) -> str:
        return linecache.getline(self.path, self.line).strip()


def parse_stacks(text: str) -> list[tuple[bool, list[Frame]]]:
    """``faulthandler``'s dump: per thread (is it the dumping one), its frames innermost
    first."""
    threads: list[tuple[bool, list[Frame]]] = []
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            threads.append((head.group(1) == "Current thread", []))
            continue
        frame = _FRAME.match(line)
        if frame and threads:
            threads[-1][1].append(Frame(frame.group(1), int(frame.group(2)), frame.group(3)))
    return threads


def main_thread(text: str) -> list[Frame]:
    """The thread that runs the script (its outermost frame is a module's), else the first
    that is not the dumping one."""
    threads = [frames for current, frames in parse_stacks(text) if not current and frames]
    for frames in threads:
        if frames[-1].function == "<module>":
            return frames
    return threads[0] if threads else []


_LIBRARY = re.compile(r"(site-packages|dist-packages|/lib/python3[.\d]*/)")
_COLLECTIVE = re.compile(r"/horovod/|/hvdkit/(torch|keras|tensorflow)/")
_DATA = re.compile(
    r"/torch/utils/data/|/keras/src/trainers/data_adapters/|/tensorflow/python/data/"
)
_STEP = {"step", "backward", "backward_and_step", "apply_gradients", "train_step"}


@dataclass(frozen=True)
class Where:
    """What a rank's main thread is doing: ``kind`` one of collective, data, lock, other;
    ``frame`` the script's own innermost frame; ``stepping``: inside an optimizer step or a
    backward pass."""

    kind: str
    frame: Frame | None
    stepping: bool

    def describe(self) -> str:
        at = self.frame.where() if self.frame else "an unknown place"
        return {
            "collective": f"in a Horovod collective, called from {at}",
            "data": f"loading data at {at}",
            "lock": f"waiting on a lock at {at}",
        }.get(self.kind, f"at {at}")


def where(frames: list[Frame]) -> Where:
    """Classify a main thread's stack (innermost first)."""
    own = next((f for f in frames if not _LIBRARY.search(f.path) and "/hvdkit/" not in f.path),
               None)  # fmt: skip
    stepping = any(
        f.function in _STEP or (f.function == "apply" and "/optimizers/" in f.path) for f in frames
    )  # an optimizer's step (Horovod's too), a backward pass
    if any(_COLLECTIVE.search(f.path) and "/hvdkit/launch/" not in f.path for f in frames[:6]):
        return Where("collective", own, stepping)
    if any(_DATA.search(f.path) or f.function in ("__getitem__", "__next__", "__iter__")
           for f in frames):  # fmt: skip
        return Where("data", own, stepping)
    innermost = frames[0] if frames else None
    locked = innermost is not None and (
        (innermost.path.endswith("threading.py") and innermost.function in ("acquire", "wait"))
        or re.search(r"\.acquire\(|with .*lock", innermost.source(), re.I) is not None
    )
    return Where("lock" if locked else "other", own, stepping)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def diagnose(stall: Stall, places: dict[int, Where | None], size: int) -> str:
    """One line: who keeps the others waiting, where, and what to do."""
    lagging = sorted(stall.missing)
    if not lagging:
        return "Horovod reported a stall but named no rank"
    waiting = [r for r in range(size) if r not in stall.missing]
    tensor = next(iter(stall.missing[lagging[0]]), "?")
    they = f"{_ranks(waiting)} wait{'s' if len(waiting) == 1 else ''}"

    known = {r: p for r, p in sorted(places.items()) if p is not None}
    stepping = [r for r, p in known.items() if p.kind == "collective" and p.stepping]
    left = [r for r in lagging if r in known and known[r].kind == "collective"
            and not known[r].stepping]  # fmt: skip
    if stepping and left:
        verb = "waits" if len(stepping) == 1 else "wait"
        return (f"{_ranks(left)} left the training loop ({known[left[0]].describe()}) while "
                f"{_ranks(stepping)} {verb} for a step's gradients: the ranks ran different "
                "numbers of batches. Give every rank the same number (DistributedSampler pads "
                "to it; hvdkit's loaders split evenly)")  # fmt: skip
    if not waiting:  # each rank lacks a tensor another submitted: they diverged
        parts = [f"rank {r} {known[r].describe()}" for r in lagging if r in known]
        return ("the ranks submitted different collectives (each misses one another "
                f"submitted): {'; '.join(parts) or 'no stacks came back'}. Every rank must "
                "call the same collectives, with the same names, in the same order")  # fmt: skip
    notes = []
    for r in lagging:
        place = places.get(r)
        if place is None:
            notes.append(f"rank {r} sent no stack (blocked in C code that holds Python's lock, "
                         "or on a host that does not share --hang-dir)")  # fmt: skip
        elif place.kind == "data":
            notes.append(f"rank {r} is {place.describe()} while {they} for it in "
                         f"{tensor}: look at its data path (a slow or stuck read, a loader "
                         "worker that died)")  # fmt: skip
        elif place.kind == "lock":
            notes.append(f"rank {r} is {place.describe()} while {they} for it in "
                         f"{tensor}: what it waits for never comes (another thread, another "
                         "process)")  # fmt: skip
        elif place.kind == "collective":
            notes.append(f"rank {r} is {place.describe()}, not in {tensor} that {_ranks(waiting)} "
                         "submitted: every rank must call the same collectives, with the same "
                         "names, in the same order")  # fmt: skip
        else:
            notes.append(f"rank {r} is {place.describe()} while {they} for it in {tensor}")
    return "; ".join(notes)


def mismatch(notes: list[dict]) -> str | None:
    """One line from the ranks' notes of a collective Horovod refused for a mismatch: each
    rank's shape and dtype, by tensor name."""
    if not notes:
        return None
    name = notes[0]["name"]
    same = sorted((n for n in notes if n["name"] == name), key=lambda n: n["rank"])
    each = ", ".join(f"rank {n['rank']} {n['shape']} {n['dtype']}" for n in same)
    what = "dtypes" if len({n["dtype"] for n in same}) > 1 else "shapes"
    return (
        f"the ranks gave {name} different {what}: {each}. Every rank must give a "
        "collective the same shape and dtype (allgather and alltoall alone take another "
        "first dimension)"
    )
