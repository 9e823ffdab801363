"""The docs cannot drift from the code: every block meant to run is run (on 2 real ranks where
it says so, which must end with the same weights), every ``hvdkit``/``make`` line parses, the
site builds with ``--strict`` and its API reference has every public name, figures are dated,
and the README stays short. The markers are described in tests/docs_blocks.py."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import docs_blocks

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PAGES = docs_blocks.read_pages(ROOT)
BLOCKS = [b for page, text in PAGES.items() for b in docs_blocks.blocks(text, page)]
RUN = [b for b in BLOCKS if b.test_id]
README_MAX_LINES = 160

# Appended to a block run with equal=VAR: each rank writes a digest of VAR's weights, which
# the test compares (a run that finishes proves nothing).
EQUAL_WEIGHTS = """
import hashlib as _hashlib, os as _os
def _digest(model):
    if not hasattr(model, "get_weights") and not hasattr(model, "state_dict"):
        return repr(model)  # a value a rank returned (Ray, Spark)
    arrays = (model.get_weights() if hasattr(model, "get_weights")
              else [t.detach().cpu().numpy() for t in model.state_dict().values()])
    return _hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()
# A list holds one result per rank (an engine's run); else this process is one rank, named
# by Gloo's or MPI's variable.
_rank = _os.environ.get("HOROVOD_RANK", _os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
_pairs = (enumerate({var}) if isinstance({var}, (list, tuple)) else [(_rank, {var})])
for _r, _value in _pairs:
    with open(_os.path.join({out!r}, f"weights-rank{{_r}}"), "w") as _f:
        _f.write(_digest(_value))
"""


def test_every_python_block_is_run_or_says_why():
    unmarked = [b.where for b in BLOCKS if b.lang == "python" and not (b.test_id or b.not_run)]
    assert not unmarked, (
        "python blocks with neither <!-- test: ID ... --> nor <!-- not run: WHY --> above "
        f"them: {unmarked}"
    )
    ids = [b.test_id for b in RUN]
    assert len(ids) == len(set(ids)), f"test IDs used twice: {ids}"
    # "copy of ID": the same code as a block that is run (the README's examples).
    run = {b.test_id: b.code for b in RUN}
    for block in BLOCKS:
        if block.not_run and block.not_run.startswith("copy of "):
            source = block.not_run.removeprefix("copy of ")
            assert run.get(source) == block.code, f"{block.where} is not a copy of {source}"


def _hvdkit_parses(argv: list[str]) -> str | None:
    from hvdkit.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as stop:
        if stop.code:
            return err.getvalue().strip().splitlines()[-1]
    return None


def test_every_hvdkit_and_make_line_parses():
    """What a reader copies must be a command today's hvdkit accepts: each ``hvdkit`` line of
    every shell block parses with hvdkit's own parser, each ``make`` target exists."""
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
    problems, checked = [], 0
    for block in BLOCKS:
        if block.lang != "bash":
            continue
        for words in docs_blocks.command_lines(block.code):
            if words[0].endswith("hvdkit"):
                checked += 1
                why = _hvdkit_parses(words[1:])
                if why:
                    problems.append(f"{block.where}: {' '.join(words)}: {why}")
            elif words[0] == "make":
                checked += 1
                wanted = [w for w in words[1:] if "=" not in w and not w.startswith("-")]
                problems += [f"{block.where}: make {t}: no such target" for t in wanted
                             if t not in targets]  # fmt: skip
    assert checked > 20, checked
    assert not problems, "\n".join(problems)


def run_block(block: docs_blocks.Block, tmp_path: Path) -> tuple[str, dict[str, str]]:
    """Run ``block`` as its marker says; its output, and with ``equal=VAR`` each rank's digest
    of ``VAR``'s weights (``weights-rankN``: digest)."""
    env = {**os.environ, **block.env, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    if block.lang == "bash":
        argv, cwd = ["bash", "-euo", "pipefail", "-c", block.code], ROOT
    elif block.lang == "python":
        code = block.code
        if "equal" in block.options:
            code += EQUAL_WEIGHTS.format(var=block.options["equal"], out=str(tmp_path))
        (tmp_path / "snippet.py").write_text(code)
        argv, cwd = [sys.executable, str(tmp_path / "snippet.py")], tmp_path
        if "np" in block.options:
            np = block.options["np"]
            argv = [str(BIN / "hvdkit"), "run", "-np", np, "-H", f"localhost:{np}", "--", *argv]
    else:
        pytest.fail(f"{block.where}: a {block.lang!r} block cannot be run; mark it python or bash")
    out = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
        timeout=float(block.options.get("timeout", 300)),
    )  # fmt: skip
    shown = f"{block.where} exited {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert out.returncode == 0, shown
    return shown, {p.name: p.read_text() for p in tmp_path.glob("weights-rank*")}


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("block", RUN, ids=[b.test_id for b in RUN])
def test_the_docs_code_runs(block, tmp_path):
    shown, digests = run_block(block, tmp_path)
    if "expect" in block.options:
        assert block.options["expect"] in shown, shown
    if "equal" in block.options:
        ranks = int(block.options.get("ranks", block.options.get("np", 1)))
        assert len(digests) == ranks, (digests, shown)
        assert len(set(digests.values())) == 1, f"ranks ended with different weights: {digests}"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_equal_weights_check_sees_ranks_that_drift_apart(tmp_path):
    """The check can fail: 2 ranks that each train alone (no hvdkit) end apart."""
    code = (
        "import os, torch\n"
        "torch.manual_seed(int(os.environ.get('HOROVOD_RANK', os.environ.get("
        "'OMPI_COMM_WORLD_RANK', '0'))))\n"
        "model = torch.nn.Linear(4, 2)\n"
    )
    drift = docs_blocks.Block("planted", 1, "python", code, "drift", {"np": "2", "equal": "model"})
    _, digests = run_block(drift, tmp_path)
    assert len(digests) == 2 and len(set(digests.values())) == 2, digests


def _public_names(module: str) -> list[str]:
    """``__all__`` of hvdkit's MODULE, read from its source (no framework imported)."""
    path = ROOT / module.replace(".", "/") / "__init__.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__":
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__")


def _in_reference(html: str, module: str, name: str) -> bool:
    """Rendered from its docstring (an anchor), or named in the page's text."""
    return f'id="{module}.{name}"' in html or f"<code>{name}</code>" in html


@pytest.mark.timeout(300)
def test_the_site_builds_strict_with_every_guide_and_public_name(tmp_path):
    site = tmp_path / "site"
    out = subprocess.run(
        [str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True,
        text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    for page in pages:
        built = site / (page[: -len(".md")] + "/index.html").replace("index/index", "index")
        assert built.exists(), f"docs/{page} was not built ({built})"
    assert (site / "search" / "search_index.json").exists()
    missing = []
    for module, page in [
        ("hvdkit.torch", "torch"), ("hvdkit.keras", "keras"), ("hvdkit.tensorflow", "tensorflow"),
        ("hvdkit.ray", "engines"), ("hvdkit.spark", "engines"),
    ]:  # fmt: skip
        html = (site / "reference" / page / "index.html").read_text()
        missing += [f"{module}.{name}" for name in _public_names(module)
                    if not _in_reference(html, module, name)]  # fmt: skip
    assert not missing, f"public names missing from the API reference: {missing}"
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("run", "build-horovod", "doctor", "bench"):
        assert f"usage: hvdkit {command}" in cli, command


def test_quoted_figures_say_when_they_were_measured():
    problems = [f"{page}: {p}" for page, text in PAGES.items()
                for p in docs_blocks.undated_figures(text)]  # fmt: skip
    assert not problems, "\n".join(problems)


def test_the_readme_is_short_and_links_into_the_docs():
    readme = PAGES["README.md"]
    assert len(readme.splitlines()) <= README_MAX_LINES, len(readme.splitlines())
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert len(links) >= 10, links
    assert not [link for link in links if not (ROOT / link).exists()], links
