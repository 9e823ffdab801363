"""Execute a notebook in a real Jupyter kernel (nbclient), for tests/test_notebooks.py: its
parameters set in the cell that defines them, the kernel interrupted during a chosen cell (as
a notebook's stop button does), and every code cell's outputs written as JSON.

    python tests/nbrun.py NOTEBOOK OUT.json [--set NAME=EXPR ...] [--cwd DIR]
        [--interrupt CELL --when GLOB --count N]

A subprocess of its own, so that a test can run it inside another network namespace (the
ssh hosts of tests/netns.py) and bound it with a timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def set_parameters(nb: nbformat.NotebookNode, values: dict[str, str]) -> None:
    """Replace ``NAME = ...`` lines of the first code cell that defines each NAME."""
    for name, expr in values.items():
        pattern = re.compile(rf"^{re.escape(name)} = .*$", re.MULTILINE)
        for cell in nb.cells:
            if cell.cell_type == "code" and pattern.search(cell.source):
                cell.source = pattern.sub(lambda m, e=expr, n=name: f"{n} = {e}", cell.source, 1)
                break
        else:
            raise SystemExit(f"nbrun: no cell sets {name}")


def outputs(cell: nbformat.NotebookNode) -> list[dict]:
    out = []
    for o in cell.get("outputs", []):
        item = {"type": o.output_type, "name": o.get("name"), "text": o.get("text", "")}
        if o.output_type == "error":
            item.update(ename=o.ename, evalue=o.evalue, traceback="\n".join(o.traceback))
        elif o.output_type in ("execute_result", "display_data"):
            item["text"] = o.get("data", {}).get("text/plain", "")
        out.append(item)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=EXPR")
    parser.add_argument("--cwd", type=Path, default=Path.cwd())
    parser.add_argument("--interrupt", type=int, metavar="CELL", help="code cell index")
    parser.add_argument("--when", help="interrupt once this many files match this glob")
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=600, help="per cell, seconds")
    args = parser.parse_args(argv)

    nb = nbformat.read(args.notebook, as_version=4)
    set_parameters(nb, dict(item.split("=", 1) for item in args.set))
    client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(args.cwd)}})  # fmt: skip
    cells, code = [], 0
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            stopped: dict[str, float] = {}
            if code == args.interrupt:

                def interrupt(stopped: dict[str, float] = stopped) -> None:
                    while len(list(Path("/").glob(args.when.lstrip("/")))) < args.count:
                        time.sleep(0.1)
                    stopped["at"] = time.monotonic()
                    # What the stop button does (the kernel's interrupt_mode is "signal"); the
                    # client's own call is a coroutine of its event loop, not of this thread.
                    os.kill(client.km.provisioner.process.pid, signal.SIGINT)

                threading.Thread(target=interrupt, daemon=True).start()
            start = time.monotonic()
            client.execute_cell(cell, index)
            end = time.monotonic()
            after = end - stopped["at"] if stopped else None
            cells.append({"code": code, "source": cell.source, "outputs": outputs(cell),
                          "seconds": end - start, "after_interrupt_s": after})  # fmt: skip
            code += 1
    args.out.write_text(json.dumps(cells, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
