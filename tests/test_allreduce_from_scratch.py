"""examples/allreduce_from_scratch.py under real processes (``hvdkit run --mpi``): the three
hand-written allreduces agree with Horovod's, the cost-model table has its rows and its
predictions follow from the printed fit, the hand-written training loop ends on hvdkit.torch's
weights; plus the cost model's arithmetic on its own."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from hvdkit.bench import costmodel
from hvdkit.bench.metrics import human_bytes

HVDKIT = str(Path(sys.executable).parent / "hvdkit")
EXAMPLE = ROOT / "examples" / "allreduce_from_scratch.py"
SIZES = (4096, 65536, 1048576)
SMALL = ("--sizes", ",".join(map(str, SIZES)), "--repeats", "3", "--steps", "5")
SCHEMES = {
    "gather+bcast (d2l)": "gather_bcast",
    "parameter server": "parameter_server",
    "ring (Sendrecv)": "ring",
}
PREFIX = re.compile(r"^\[rank \d+\] ", re.MULTILINE)


def launch(
    np: int, *args: str, script: Path = EXAMPLE, controller: str = "mpi", timeout: float = 200
) -> subprocess.CompletedProcess:
    """``hvdkit run --CONTROLLER -np N -H localhost:N -- python SCRIPT ARGS``."""
    argv = [HVDKIT, "run", f"--{controller}", "-np", str(np), "-H", f"localhost:{np}", "--"]
    return subprocess.run(
        [*argv, sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )


def passed(np: int, *args: str, timeout: float = 200) -> str:
    out = launch(np, *args, timeout=timeout)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return PREFIX.sub("", out.stdout)


def model_rows(out: str) -> list[dict]:
    """The cost-model tables' rows (columns are separated by two spaces or more)."""
    rows = []
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        kinds = ("measured", "predicted")
        if len(cells) == 9 and cells[0] in (*SCHEMES, "horovod") and cells[8] in kinds:
            keys = ("scheme", "n", "size", "sent", "link", "predicted", "measured", "ratio", "kind")
            rows.append(dict(zip(keys, cells, strict=True)))
    return rows


def fitted(out: str) -> costmodel.AlphaBeta:
    m = re.search(r"alpha = ([\d.]+) us, beta = ([\d.]+) ns/byte", out)
    assert m, out
    return costmodel.AlphaBeta(float(m.group(1)) * 1e-6, float(m.group(2)) * 1e-9)


def check_report(out: str, n: int, extrapolated: tuple[int, ...] = (16, 512)) -> None:
    """What every passing run must show, for a world of ``n`` ranks."""
    assert out.count("allreduce from scratch: N=") == 1, out  # rank 0 prints, once
    checks = re.findall(r"check (.+?)\s+vs hvdkit\.torch\.allreduce\(op=(\w+)\)\s*: (\w+)", out)
    assert {(s.strip(), op, v) for s, op, v in checks} == {
        ("gather+bcast (d2l)", "Sum", "OK"),
        ("parameter server", "Average", "OK"),
        ("ring (Sendrecv)", "Sum", "OK"),
    }, out
    for nbytes in SIZES:  # one timing row and one bus-bandwidth row per size, 5 and 4 numbers
        label = re.escape(human_bytes(nbytes))
        assert re.search(rf"^\s*{label}(\s+[\d.]+\s+\([\d.]+\)){{4}}\s+[\d.]+\s*$", out, re.M)
        assert re.search(rf"^\s*{label}(\s+[\d.]+){{4}}\s*$", out, re.M), out

    rows, model = model_rows(out), fitted(out)
    world_sizes = sorted({*range(2, n + 1), *extrapolated})
    for size in (SIZES[0], SIZES[-1]):
        at = [r for r in rows if r["size"] == human_bytes(size)]
        expected = {(s, str(r)) for s in SCHEMES for r in world_sizes} | {("horovod", str(n))}
        assert {(r["scheme"], r["n"]) for r in at} == expected, out
        for row in at:
            assert row["kind"] == ("measured" if row["n"] == str(n) else "predicted"), row
            assert (row["measured"] != "-") == (row["kind"] == "measured"), row
            if row["scheme"] == "horovod":
                assert float(row["measured"]) > 0, row
                continue
            # The printed prediction is the model's, from the printed (rounded) fit.
            want = costmodel.predict(model, SCHEMES[row["scheme"]], int(row["n"]), size) * 1e3
            assert math.isclose(float(row["predicted"]), want, rel_tol=0.01, abs_tol=0.002), row
            cost = costmodel.cost(SCHEMES[row["scheme"]], int(row["n"]), size)
            assert row["link"] == human_bytes(round(cost.link_bytes)), row

    m = re.search(r"max \|w_hand - w_hvdkit\| after 5 steps: (\S+) \(tolerance (\S+)\): OK", out)
    assert m and float(m.group(1)) <= float(m.group(2)) <= 1e-5, out
    assert f"identical weights on all {n} ranks: by hand yes" in out, out
    assert re.search(r"; hvdkit\.torch yes \(", out), out
    assert out.rstrip().endswith("allreduce_from_scratch: all checks passed"), out


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_ranks_match_horovod_and_the_model_table(tmp_path):
    out = passed(2, *SMALL, "--out", str(tmp_path))
    check_report(out, 2)
    assert (tmp_path / "allreduce_from_scratch_N2.png").stat().st_size > 10_000


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_without_an_mpi_world_it_names_the_fix():
    out = launch(2, *SMALL, controller="gloo", timeout=100)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "needs an MPI world" in text and "hvdkit run --mpi" in text, text
    assert "Traceback" not in text, text


BROKEN = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("example", {path!r})
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)
# The bug the checks must catch: a ring that never talks to its neighbours.
example.ring_allreduce = example.HAND["ring"] = lambda comm, x: x.copy()
sys.exit(example.main())
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_wrong_allreduce_fails_the_checks_and_the_exit_status(tmp_path):
    script = tmp_path / "broken_ring.py"
    script.write_text(BROKEN.format(path=str(EXAMPLE)))
    out = launch(2, *SMALL, script=script)
    text = PREFIX.sub("", out.stdout)
    assert out.returncode != 0, text + out.stderr[-3000:]
    assert re.search(r"check ring \(Sendrecv\)\s+vs .*: MISMATCH", text), text
    assert re.search(r"check parameter server\s+vs .*: OK", text), text
    assert "MISMATCH" in text.split("max |w_hand - w_hvdkit|")[1].splitlines()[0], text
    assert "identical weights on all 2 ranks: by hand NO" in text, text
    assert "CHECKS FAILED" in text, text


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_four_ranks_on_a_two_slot_machine():
    check_report(passed(4, *SMALL, timeout=280), 4)


def test_cost_model_formulas():
    s = 1 << 20
    for n in (2, 4, 16, 512):
        ps, ring = costmodel.cost("parameter_server", n, s), costmodel.cost("ring", n, s)
        assert ps.link_bytes == 2 * (n - 1) * s and ps.steps == ring.steps == 2 * (n - 1)
        assert ring.link_bytes == pytest.approx(2 * (n - 1) / n * s) and ring.link_bytes < 2 * s
    assert costmodel.cost("gather_bcast", 16, s) == costmodel.Cost(15 + 4, 19 * s, 4 * s)
    assert costmodel.tree_rounds(1) == 0 and costmodel.tree_rounds(5) == 3
    with pytest.raises(ValueError, match="unknown scheme"):
        costmodel.cost("tree", 4, s)


def test_fit_recovers_alpha_and_beta_and_clamps_negative_latency():
    truth = costmodel.AlphaBeta(alpha=20e-6, beta=0.25e-9)
    sizes = [4096 * 4**k for k in range(7)]
    times = [truth.time(costmodel.Cost(1, s, s)) for s in sizes]
    got = costmodel.fit([1] * len(sizes), sizes, times)
    assert got.alpha == pytest.approx(truth.alpha, rel=1e-6)
    assert got.beta == pytest.approx(truth.beta, rel=1e-6)
    # Ring-shaped points (2(N-1) steps, 2(N-1)/N S bytes) fit the same two numbers.
    ring = [costmodel.cost("ring", 4, s) for s in sizes]
    got = costmodel.fit([c.steps for c in ring], [c.link_bytes for c in ring],
                        [truth.time(c) for c in ring])  # fmt: skip
    assert got.alpha == pytest.approx(truth.alpha, rel=1e-6)
    # Times that shrink at small sizes would give a negative latency: 0, beta refitted.
    clamped = costmodel.fit([1, 1, 1], [1000, 2000, 4000], [0.5e-6, 2.1e-6, 4.0e-6])
    assert clamped.alpha == 0 and clamped.beta > 0
    with pytest.raises(ValueError):
        costmodel.fit([1], [1000], [1e-6])
